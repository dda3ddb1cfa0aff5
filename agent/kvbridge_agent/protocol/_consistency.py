"""Is one engine's v11 metadata consistent with itself? (spec §1.3, §1.6, §3.)

A reply can decode cleanly and still describe no engine that could exist: per-region lists
of different lengths, a stride shorter than its block, a capacity of zero, a memory type NIXL
does not know. Such a peer is broken whatever it is compared with, so this check needs no
local geometry: ``kvbridge probe`` runs it on every reply, and every handshake runs it before
comparing geometries. Each problem names the field, the expected and the found value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._verdict import Incompatibility, Rule, Verdict
from ._wire import SHARED_REGION_GROUP_ID, NixlAgentMetadata

__all__ = ["MEMORY_TYPES", "check_metadata"]

#: The memory types a region may declare (spec §1.3 ``region_mem_types``); the same as
#: ``geometry.MEM_TYPES``, which protocol cannot import (geometry needs numpy; protocol
#: imports nothing impure, tests/unit/test_protocol_api.py) — a unit test keeps them equal.
MEMORY_TYPES = ("DRAM", "VRAM")

_PER_REGION: tuple[tuple[str, Rule], ...] = (
    ("block_lens", Rule.BLOCK_LENS),
    ("block_strides", Rule.BLOCK_STRIDES),
    ("region_num_blocks", Rule.REGION_NUM_BLOCKS),
    ("region_group_ids", Rule.REGION_GROUP_IDS),
    ("region_names", Rule.REGION_NAMES),
    ("region_mem_types", Rule.REGION_MEM_TYPES),
)


def check_metadata(meta: NixlAgentMetadata) -> Verdict:
    """Every inconsistency of ``meta`` on its own (``ok`` when there is none)."""
    problems: list[Incompatibility] = []

    def add(rule: Rule, field: str, expected: Any, found: Any, why: str) -> None:
        problems.append(Incompatibility(
            rule, field, expected, found,
            f"{field}: expected {expected}, got {found!r}: {why}"))

    if not meta.engine_id:
        add(Rule.ENGINE_ID, "engine_id", "a non-empty engine id", meta.engine_id,
            "requests name their prefill engine by it")
    for field, value in (("num_blocks", meta.num_blocks), ("block_size", meta.block_size),
                         ("physical_blocks_per_logical_kv_block",
                          meta.physical_blocks_per_logical_kv_block)):
        if value < 1:
            add(Rule.NUM_BLOCKS if field == "num_blocks" else Rule.BLOCK_SIZE, field,
                ">= 1", value, "the descriptor math divides and multiplies by it")
    r = meta.num_regions
    if r == 0:
        add(Rule.NUM_REGIONS, "len(kv_caches_base_addr)", ">= 1", 0,
            "an engine registers at least one KV region")
    for name, rule in _PER_REGION:
        values = getattr(meta, name)
        if values is not None and len(values) != r:
            add(rule, f"len({name})", f"{r} (one entry per region of kv_caches_base_addr)",
                len(values), "every per-region list has one entry per region")
    _per_region(meta, add)
    return Verdict(tuple(problems))


def _per_region(meta: NixlAgentMetadata, add: Any) -> None:
    """Value checks of each region, over the entries the lists have."""
    for i, (blen, stride) in enumerate(zip(meta.block_lens, meta.block_strides, strict=False)):
        if blen < 1:
            add(Rule.BLOCK_LENS, f"block_lens[{i}]", ">= 1", blen, "a block holds bytes")
        elif stride < blen:
            add(Rule.BLOCK_STRIDES, f"block_strides[{i}]", f">= block_lens[{i}] ({blen})",
                stride, "a block stride must cover its block")
    for i, cap in enumerate(meta.region_num_blocks or ()):
        if cap < 1:
            add(Rule.REGION_NUM_BLOCKS, f"region_num_blocks[{i}]", ">= 1", cap,
                "a region holds at least one block")
    for i, gid in enumerate(meta.region_group_ids or ()):
        if gid < SHARED_REGION_GROUP_ID:
            add(Rule.REGION_GROUP_IDS, f"region_group_ids[{i}]",
                f">= {SHARED_REGION_GROUP_ID} (a group, or {SHARED_REGION_GROUP_ID} for shared)",
                gid, "group ids index the request's block lists")
    for i, kind in enumerate(meta.region_mem_types or ()):
        if kind not in MEMORY_TYPES:
            add(Rule.REGION_MEM_TYPES, f"region_mem_types[{i}]", " or ".join(MEMORY_TYPES),
                kind, "NIXL registers DRAM or VRAM")
    _unique_names(meta.region_names, add)


def _unique_names(names: Sequence[str] | None, add: Any) -> None:
    first: dict[str, int] = {}
    for i, name in enumerate(names or ()):
        if not name:
            add(Rule.REGION_NAMES, f"region_names[{i}]", "a non-empty name", name,
                "P and D pair regions by name")
        elif name in first:
            add(Rule.REGION_NAMES, f"region_names[{i}]",
                f"a name unlike region_names[{first[name]}]", name,
                "P and D pair regions by name and order")
        first.setdefault(name, i)
