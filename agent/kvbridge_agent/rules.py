"""The compatibility and consistency rules, each written once (spec §1.3, §1.6, §5, §10.11).

A rule is a :class:`RuleDef`: an id, the verdict rule it reports under, the field it names and
the one sentence that says why. The checks below are small pure functions over neutral values
(a version, a rank, per-region lists, memory types and a mode); each failed check is a
:class:`Finding`, whose message always reads ``"<field>: expected <x>, got <y>: <why>"``.
The webhook, the planner, the handshake, the agent's registration and the push engine run
these functions and turn findings into their own error type, so one rule has one message.

Fields are named as on the wire (``block_strides[2]``); a caller that speaks another
vocabulary (KVEndpoint paths, ``EngineInfo`` attributes) passes ``name``, which renames every
field a message mentions. Standard library only: ``protocol`` (which must not import numpy)
and ``geometry`` both import this module.

spec §N: sections of docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MEM_TYPES",
    "MODES",
    "NIXL_CONNECTOR_VERSION",
    "PER_REGION_LISTS",
    "RULES",
    "SHARED_GROUP_ID",
    "UNKNOWN_TRANSPORT",
    "Finding",
    "RuleDef",
    "block_stride",
    "check_engine",
    "check_lengths",
    "check_names",
    "check_regions",
    "check_strides",
    "mem_type",
    "mixed_needs_mla",
    "protocol_version",
    "push_group_layout",
    "single_memory",
    "sizes_divide",
    "tp_rank",
    "transport_accepted",
]

#: The NIXL connector version kvbridge speaks (spec §1.4). History: 1 compatibility hash ·
#: 2 remote_request_id · 3 ppl field · 4 lease heartbeats · 5 expiry time + clock-sync
#: timestamp · 6 speculative config in hash · 7 transfer mode in hash · 8 dcp_size/pcp_size ·
#: 9 block_strides · 10 dense virtual pages for compressed MLA · 11 per-region geometry and
#: memory types · 12 (later, not implemented) region_members for PP push.
NIXL_CONNECTOR_VERSION = 11

#: NIXL memory types a region may live in (spec §1.3 ``region_mem_types``). Sorted:
#: registrations and descriptor lists go DRAM first.
MEM_TYPES: tuple[str, ...] = ("DRAM", "VRAM")

#: Transfer modes: decode READs from prefill (pull) or prefill WRITEs into decode (push).
MODES: tuple[str, ...] = ("pull", "push")

#: Group id of a region overlaid by several transfer groups (vLLM's _SHARED_REGION_GROUP_ID).
SHARED_GROUP_ID = -1

#: The per-region lists of v11 metadata, in wire order; each has one entry per region.
PER_REGION_LISTS = (
    "block_lens",
    "block_strides",
    "region_num_blocks",
    "region_group_ids",
    "region_names",
    "region_mem_types",
)

Names = Callable[[str], str]


def _same(field: str) -> str:
    return field


@dataclass(frozen=True)
class RuleDef:
    """One rule: ``id`` is unique, ``reports`` the verdict rule (``protocol.Rule``) a finding
    is filed under, ``why`` ends every message, ``field`` is the wire field the rule names
    (default: the one its verdict rule is named after)."""

    id: str
    reports: str
    why: str
    field: str = ""

    def __post_init__(self) -> None:
        if not self.field:
            object.__setattr__(self, "field", self.reports)

    def finding(self, field: str, expected: str, found: Any, note: str = "") -> Finding:
        return Finding(self, field, expected, found, note)


@dataclass(frozen=True)
class Finding:
    """One failed rule: the field (as the caller names it), what was expected, what was found;
    ``note`` says where (which engine, which regions) when the field alone does not."""

    rule: RuleDef
    field: str
    expected: str
    found: Any
    note: str = ""

    @property
    def text(self) -> str:
        """The message without the leading field (for callers that print the field apart)."""
        note = f" ({self.note})" if self.note else ""
        return f"expected {self.expected}, got {self.found!r}: {self.rule.why}{note}"

    @property
    def message(self) -> str:
        return f"{self.field}: {self.text}"


# -- the table ---------------------------------------------------------------------------------

_MIXED_NEEDS_MLA = ("mixed-device KV registration is only supported for MLA models without "
                    "Mamba layers")
_PUSH_GROUPS = ("NixlPushConnector does not support different producer and consumer "
                "cache-group layouts")
_DIVIDE = "sizes are positive and divide one another (ranks map onto whole ranks)"
_POSITIVE = "the descriptor math divides and multiplies by it"
_ONE_PER_REGION = "every per-region list has one entry per region"

#: Every rule by id: (id, verdict rule it reports under, why[, wire field]).
RULES: dict[str, RuleDef] = {row[0]: RuleDef(*row) for row in (
    ("protocol_version", "protocol_version",
     "the wire format and the descriptor math differ between versions"),
    ("tp_rank", "tp_rank", "tensor-parallel ranks count from 0"),
    *((f"{k}_sizes_divide", f"{k}_size", f"{k.upper()} {_DIVIDE}") for k in ("tp", "dcp", "pcp")),
    ("engine_id", "engine_id", "requests name their prefill engine by it"),
    ("positive_num_blocks", "num_blocks", _POSITIVE),
    ("positive_block_size", "block_size", _POSITIVE),
    ("positive_physical_blocks_per_logical_kv_block", "block_size", _POSITIVE,
     "physical_blocks_per_logical_kv_block"),
    ("num_regions", "num_regions", "an engine registers at least one KV region",
     "len(kv_caches_base_addr)"),
    *((f"len_{n}", n, _ONE_PER_REGION, f"len({n})") for n in PER_REGION_LISTS),
    ("block_len", "block_lens", "a block holds bytes"),
    ("block_stride", "block_strides", "a block stride must cover its block"),
    ("region_capacity", "region_num_blocks", "a region holds at least one block"),
    ("group_id", "region_group_ids", "group ids index the request's block lists"),
    ("mem_type", "region_mem_types", "NIXL registers DRAM or VRAM"),
    ("region_name", "region_names", "P and D pair regions by name"),
    ("unique_region_name", "region_names", "P and D pair regions by name and order"),
    ("push_single_memory", "mixed_memory",
     "NixlPushConnector does not support mixed-memory KV caches", "region_mem_types"),
    ("producer_single_memory", "mixed_memory",
     "NIXL pull does not yet support a mixed-memory producer", "region_mem_types"),
    ("mixed_needs_mla", "mamba", _MIXED_NEEDS_MLA, "region_mem_types"),
    ("push_group_layout", "push_group_layout", _PUSH_GROUPS, "region_group_ids"),
)}
_R = RULES


# -- engine-wide values ------------------------------------------------------------------------

def protocol_version(version: int, *, name: Names = _same, note: str = "") -> Finding | None:
    """kvbridge speaks exactly :data:`NIXL_CONNECTOR_VERSION`."""
    if version == NIXL_CONNECTOR_VERSION:
        return None
    return _R["protocol_version"].finding(
        name("protocol_version"),
        f"{NIXL_CONNECTOR_VERSION} (the NIXL connector version kvbridge speaks)", version, note)


def tp_rank(rank: int, size: int, *, name: Names = _same) -> Finding | None:
    """A tensor-parallel rank lies in ``[0, size)``."""
    if 0 <= rank < size:
        return None
    return _R["tp_rank"].finding(name("tp_rank"), f"a rank below {name('tp_size')} ({size})", rank)


def sizes_divide(kind: str, size: int, other: int, *, field: str, other_field: str,
                 note: str = "") -> Finding | None:
    """Two engines' ``kind`` (tp, dcp, pcp) parallel sizes are positive and the larger is a
    multiple of the smaller (spec §1.9)."""
    lo, hi = sorted((size, other))
    if lo > 0 and hi % lo == 0:
        return None
    return _R[f"{kind}_sizes_divide"].finding(
        field, f"a multiple or divisor of {other_field} ({other})", size, note)


def check_engine(engine_id: str, positive: dict[str, int]) -> list[Finding]:
    """A non-empty engine id; each of ``positive`` (``num_blocks``, ``block_size``, ``ppl``
    by wire name) at least 1."""
    out = [] if engine_id else [
        _R["engine_id"].finding("engine_id", "a non-empty engine id", engine_id)]
    return out + [_R[f"positive_{f}"].finding(f, ">= 1", v) for f, v in positive.items() if v < 1]


# -- per-region lists --------------------------------------------------------------------------

def check_lengths(num_regions: int, lists: dict[str, Sequence[Any] | None], *,
                  name: Names = _same) -> list[Finding]:
    """Each per-region list (``None``: absent, a v10 peer) has ``num_regions`` entries."""
    return [
        _R[f"len_{n}"].finding(name(f"len({n})"), f"{num_regions} (one entry per region)", len(v))
        for n, v in lists.items() if v is not None and len(v) != num_regions
    ]


def block_stride(stride: int, block_len: int, *, field: str = "block_stride",
                 ref: str = "block_len") -> Finding | None:
    """A block stride covers its block (``stride >= block_len``); a ``block_len`` below 1 is
    the ``block_len`` rule's to report."""
    if block_len < 1 or stride >= block_len:
        return None
    return _R["block_stride"].finding(field, f">= {ref} ({block_len})", stride)


def check_strides(block_lens: Iterable[int], block_strides: Iterable[int], *,
                  name: Names = _same) -> list[Finding]:
    """:func:`block_stride` over the regions (the lists' common prefix)."""
    return [
        _R["block_stride"].finding(name(f"block_strides[{i}]"),
                                   f">= {name(f'block_lens[{i}]')} ({n})", s)
        for i, (n, s) in enumerate(zip(block_lens, block_strides, strict=False))
        if n >= 1 and s < n
    ]


def mem_type(kind: str, *, field: str = "mem_type") -> Finding | None:
    """A region's memory type is one NIXL registers (:data:`MEM_TYPES`)."""
    if kind in MEM_TYPES:
        return None
    return _R["mem_type"].finding(field, " or ".join(MEM_TYPES), kind)


def check_names(names: Iterable[str] | None, *, name: Names = _same) -> list[Finding]:
    """Region names are non-empty and unique."""
    names = list(names or ())
    out, first = [], {}
    if all(names) and len(set(names)) == len(names):
        return out  # the usual case, without a Python loop
    for i, n in enumerate(names):
        if not n:
            out.append(_R["region_name"].finding(name(f"region_names[{i}]"), "a non-empty name", n))
        elif n in first:
            out.append(_R["unique_region_name"].finding(
                name(f"region_names[{i}]"), f"a name unlike {name(f'region_names[{first[n]}]')}",
                n))
        first.setdefault(n, i)
    return out


def check_regions(num_regions: int, lists: dict[str, Sequence[Any] | None]) -> list[Finding]:
    """Everything that makes per-region lists consistent with themselves: at least one region,
    the lengths, then each entry (over the entries the lists have). Each list is scanned
    entry by entry only when ``min``/``set`` (C loops) say it holds a bad entry."""
    out = [] if num_regions else [_R["num_regions"].finding("len(kv_caches_base_addr)", ">= 1", 0)]
    out += check_lengths(num_regions, lists)
    lens = lists.get("block_lens") or ()
    out += check_strides(lens, lists.get("block_strides") or ())
    for field, rule, low, expected in (
        ("block_lens", "block_len", 1, ">= 1"),
        ("region_num_blocks", "region_capacity", 1, ">= 1"),
        ("region_group_ids", "group_id", SHARED_GROUP_ID,
         f">= {SHARED_GROUP_ID} (a group, or {SHARED_GROUP_ID} for shared)"),
    ):
        values = lists.get(field) or ()
        if min(values, default=low) < low:
            out += [_R[rule].finding(f"{field}[{i}]", expected, v)
                    for i, v in enumerate(values) if v < low]
    types = lists.get("region_mem_types") or ()
    if not set(types) <= set(MEM_TYPES):
        out += [f for i, t in enumerate(types)
                if (f := mem_type(t, field=f"region_mem_types[{i}]"))]
    return out + check_names(lists.get("region_names"))


# -- memory types per mode ---------------------------------------------------------------------

def _kinds(mem_types: Iterable[str]) -> list[str]:
    return sorted(set(mem_types))


def single_memory(mem_types: Iterable[str], *, mode: str, producer: bool, name: Names = _same,
                  note: str = "") -> Finding | None:
    """Push mode needs one memory type on both sides; pull mode on the producer (spec §5)."""
    kinds = _kinds(mem_types)
    if len(kinds) < 2 or (mode != "push" and not producer):
        return None
    if mode == "push":
        return _R["push_single_memory"].finding(
            name("region_mem_types"), "one memory type in push mode", kinds, note)
    return _R["producer_single_memory"].finding(
        name("region_mem_types"), "one memory type on a pull-mode producer", kinds, note)


def mixed_needs_mla(mem_types: Iterable[str], *, is_mla: bool, mamba: bool = False,
                    name: Names = _same, note: str = "") -> Finding | None:
    """Mixed DRAM/VRAM regions need an MLA model without Mamba layers (spec §2.5)."""
    kinds = _kinds(mem_types)
    if len(kinds) < 2 or (is_mla and not mamba):
        return None
    return _R["mixed_needs_mla"].finding(
        name("region_mem_types"),
        f"one memory type (mixed types need {name('is_mla')}: true and no Mamba layers)",
        kinds, note)


def push_group_layout(producer: Sequence[int], consumer: Sequence[int], *,
                      note: str = "") -> Finding | None:
    """In push mode the consumer's cache-group layout equals the producer's (spec §5)."""
    if tuple(producer) == tuple(consumer):
        return None
    return _R["push_group_layout"].finding(
        "region_group_ids", f"the producer's layout {list(producer)}", list(consumer), note)


#: What an agent reports when UCX's tables could not tell a peer's transport
#: (nixl/_transport.py); never counted as a fallback.
UNKNOWN_TRANSPORT = "unknown"


def transport_accepted(transport: str, accepted: Iterable[str]) -> bool:
    """Whether every part of ``transport`` is accepted: a listed name, or a family prefix of
    one (``rc`` accepts ``rc_mlx5`` and ``rc_verbs``). An empty list accepts everything;
    ``unknown`` is never a fallback (nothing says it is one)."""
    allowed = tuple(accepted)
    if not allowed or transport == UNKNOWN_TRANSPORT:
        return True
    return all(any(part == a or part.startswith(a + "_") for a in allowed)
               for part in transport.split("+"))
