"""Is one engine's v11 metadata consistent with itself? (spec §1.3, §1.6, §3.)

A reply can decode cleanly and still describe no engine that could exist: per-region lists
of different lengths, a stride shorter than its block, a capacity of zero, a memory type NIXL
does not know. Such a peer is broken whatever it is compared with, so this check needs no
local geometry: ``kvbridge probe`` runs it on every reply, and every handshake runs it before
comparing geometries. The rules are :mod:`kvbridge_agent.rules`'; each problem names the
field, the expected and the found value.
"""

from __future__ import annotations

from typing import Any

from .. import rules
from ..rules import MEM_TYPES as MEMORY_TYPES
from ._verdict import Incompatibility, Rule, Verdict
from ._wire import NixlAgentMetadata

__all__ = ["MEMORY_TYPES", "check_metadata", "incompatibility"]


def incompatibility(finding: rules.Finding, *sides: Any) -> Incompatibility:
    """A rule-table finding as a verdict item: ``local`` is what was expected and ``remote``
    what was found, unless ``sides`` gives the (local, remote) values compared."""
    local, remote = sides or (finding.expected, finding.found)
    return Incompatibility(Rule(finding.rule.reports), finding.field, local, remote,
                           finding.message)


def check_metadata(meta: NixlAgentMetadata) -> Verdict:
    """Every inconsistency of ``meta`` on its own (``ok`` when there is none)."""
    findings = rules.check_engine(meta.engine_id, {
        "num_blocks": meta.num_blocks, "block_size": meta.block_size,
        "physical_blocks_per_logical_kv_block": meta.physical_blocks_per_logical_kv_block})
    findings += rules.check_regions(
        meta.num_regions, {n: getattr(meta, n) for n in rules.PER_REGION_LISTS})
    return Verdict(tuple(incompatibility(f) for f in findings))
