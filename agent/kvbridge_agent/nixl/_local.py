"""This engine's side of the data plane: registered memory and local descriptor lists.

A :class:`LocalEngine` registers a geometry ``RegionPlan`` with its :class:`~.agent.NixlAgent`
(one call per memory kind) and prepares the local descriptor lists lazily, once per
(block_size_ratio, split) key and memory kind, against ``"NIXL_INIT_AGENT"`` (spec §2.7).
Mixed-memory plans get one list per kind plus the geometry ``MemTypeIndex`` that maps a
descriptor id to (kind, position inside that kind's list). :meth:`LocalEngine.zero` zeroes
local byte ranges per kind through ``_zeroing.zero_ranges`` (spec §4.9).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import geometry as geo
from ._agent import DList, NixlAgent
from ._readplan import local_desc_layout
from ._remote import RemoteEngine
from ._zeroing import zero_ranges

__all__ = ["EngineFacts", "LocalEngine", "LocalLists"]


@dataclass(frozen=True)
class EngineFacts:
    """Facts about this engine that the region plan does not carry.

    Attributes:
        engine_id: this engine's id.
        tp_rank / tp_size: this worker's transfer TP rank and size.
        block_size: kernel block size in tokens.
        ppl: physical (kernel) blocks per logical block.
        num_blocks: kernel block count of the main pool (default: largest region capacity).
        device_id: CUDA ordinal of this worker's VRAM (0 on CPU).
    """

    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    block_size: int = 16
    ppl: int = 1
    num_blocks: int | None = None
    device_id: int = 0


@dataclass(frozen=True)
class LocalLists:
    """The local lists of one (k, split) key: the full table, its kind index, one DList
    per kind (kinds in ``index.mem_types`` order)."""

    k: int
    table: np.ndarray
    index: Any  # geometry.MemTypeIndex
    by_kind: dict[str, DList]


class LocalEngine:
    """Registered KV memory of this engine plus its prepared local lists.

    Args:
        agent: the NIXL agent that owns registrations and lists (closed by its owner).
        views: a geometry ``RegionPlan``, or ``CacheView`` objects to plan from
            (torch tensors or raw ranges go through ``CacheView.from_tensor/from_range``).
        facts: see :class:`EngineFacts`.

    Raises:
        GeometryError: the views do not form a valid plan.
        NixlCallError: registration failed (e.g. VRAM on a host pointer).
    """

    def __init__(self, agent: NixlAgent, views: Any, facts: EngineFacts) -> None:
        plan = views if isinstance(views, geo.RegionPlan) else geo.plan_regions(
            list(views) if isinstance(views, Iterable) else views)
        self.agent = agent
        self.plan = plan
        self.facts = facts
        self._lists: dict[tuple[int, int, int], LocalLists] = {}
        self._layouts: dict[tuple[int, bool], geo.DescIdLayout] = {}
        agent.register_plan(plan)

    @property
    def engine_id(self) -> str:
        return self.facts.engine_id

    @property
    def num_blocks(self) -> int:
        if self.facts.num_blocks is not None:
            return int(self.facts.num_blocks)
        caps = self.plan.region_num_blocks
        return int(caps.max()) if len(caps) else 0

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(int(g) for g in self.plan.group_ids)

    @property
    def pure_mla(self) -> bool:
        return all(self.plan.is_mla)

    def lists(self, k: int = 1, *, split_reads: int = 1, split_index: int = 0) -> LocalLists:
        """Local lists at sub-block ratio ``k`` (prepared on first use, then cached)."""
        key = (int(k), int(split_reads), int(split_index))
        got = self._lists.get(key)
        if got is not None:
            return got
        table = geo.local_descriptor_table(
            self.plan, k, split_reads=split_reads, split_index=split_index)
        index = geo.mem_type_index(self.plan.mem_types, self.plan.region_num_blocks, k)
        parts = geo.split_table_by_mem_type(table, index)
        by_kind = {kind: self.agent.prep_local(parts[kind], kind) for kind in index.mem_types}
        got = LocalLists(k=int(k), table=table, index=index, by_kind=by_kind)
        self._lists[key] = got
        return got

    def desc_layout(self, k: int, region_mapped: bool) -> geo.DescIdLayout:
        """The ``geometry.DescIdLayout`` of the local list at ratio ``k`` for the
        group-matched path, or the region-mapped one (k = 1); built once per key."""
        key = (int(k), bool(region_mapped))
        got = self._layouts.get(key)
        if got is None:
            got = self._layouts[key] = local_desc_layout(self.plan, key[0], key[1])
        return got

    def zero(self, ranges: dict[str, np.ndarray]) -> int:
        """Zero ``{kind: (N, 3) rows of (addr, nbytes, device_id)}`` (what
        ``geometry.untransferred_ranges`` returns) in this engine's memory; each kind goes
        through its NIXL memory type (so CPU tests memset their stand-in "VRAM"). Returns
        the bytes zeroed."""
        return sum(zero_ranges(rows, self.agent.mem_types.nixl_type(kind))
                   for kind, rows in ranges.items())

    def describe(self, *, agent_metadata: bytes | None = None) -> RemoteEngine:
        """This engine as a peer sees it (what the v11 handshake would carry)."""
        p = self.plan
        return RemoteEngine(
            engine_id=self.facts.engine_id,
            agent_metadata=self.agent.metadata() if agent_metadata is None else agent_metadata,
            tp_rank=self.facts.tp_rank,
            tp_size=self.facts.tp_size,
            num_blocks=self.num_blocks,
            block_size=self.facts.block_size,
            ppl=self.facts.ppl,
            device_id=self.facts.device_id,
            base_addrs=tuple(int(a) for a in p.addrs),
            block_lens=tuple(int(x) for x in p.block_lens),
            block_strides=tuple(int(x) for x in p.block_strides),
            region_num_blocks=tuple(int(x) for x in p.region_num_blocks),
            region_group_ids=self.group_ids,
            region_mem_types=tuple(p.mem_types),
            region_names=tuple(p.names),
            agent_name=self.agent.name,
        )
