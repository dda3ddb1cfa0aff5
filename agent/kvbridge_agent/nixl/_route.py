"""The common pull, planned once per peer, so that a request pays only for its own ids.

Most requests of a P/D deployment have one shape: one source rank (equal TP sizes), one
memory type per side, the same transfer groups and block size on both engines, and per
group a decode list no longer than the prefill's (the decode's prefix hits shorten it).
For that shape everything except the block ids is fixed once the peer is loaded: the two
prepared lists, the descriptor-id layouts and the completion message's consumer count.
:class:`ReadRoute` holds them; :meth:`ReadRoute.read_ids` turns a request's block ids into
the paired descriptor ids, the same numbers ``plan_read_ids`` computes (a property test,
``tests/integration/test_read_route.py``, compares them), or returns None for a request the
general planner handles.

Pure given its inputs: the NIXL lists are built by the pull engine and only carried here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import geometry as geo
from ._agent import DList

__all__ = ["ReadRoute", "route_eligible"]


def route_eligible(
    *,
    local_group_ids: Sequence[int],
    remote_group_ids: Sequence[int],
    local_block_size: int,
    remote_block_size: int,
    local_kinds: Sequence[str],
    remote_kinds: Sequence[str],
    source_ranks: int,
    notify_ranks: int,
    split_reads: int,
) -> bool:
    """Whether every request to this peer has the route's shape, apart from its ids."""
    return (source_ranks == 1 and notify_ranks == 0 and split_reads == 1
            and local_block_size == remote_block_size
            and len(local_kinds) == 1 and len(remote_kinds) == 1
            and len(remote_group_ids) > 0
            and tuple(local_group_ids) == tuple(remote_group_ids))


@dataclass(frozen=True, eq=False)
class ReadRoute:
    """What a request to one eligible peer needs besides its block ids."""

    agent_name: str
    local_list: DList
    remote_list: DList
    local_layout: geo.DescIdLayout
    remote_layout: geo.DescIdLayout
    local_ppl: int
    remote_ppl: int
    local_consumers: int
    label: str
    #: the local regions' block lengths (what one descriptor of each region moves)
    block_lens: np.ndarray
    _id_bytes: dict[int, int] = field(default_factory=dict, repr=False)
    #: one transfer group, ppl 1 on both sides (the usual engine): the two layouts' id
    #: tables (``DescIdLayout.id_table``) and the bytes one block id moves, else None
    _one_group: tuple[np.ndarray, np.ndarray, int] | None = field(
        init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        lo, ro = self.local_layout, self.remote_layout
        if (self.local_ppl != 1 or self.remote_ppl != 1
                or lo.block_size_ratio not in (None, 1) or ro.block_size_ratio not in (None, 1)):
            return
        ltable, rtable = lo.id_table(), ro.id_table()
        if ltable is not None and rtable is not None:
            object.__setattr__(self, "_one_group", (ltable, rtable, int(self.block_lens.sum())))

    def id_bytes(self, group: int) -> int:
        """Bytes one block id of ``group`` moves: the block lengths of the regions its ids
        go to, as the layout maps them (every region when there is one group)."""
        got = self._id_bytes.get(group)
        if got is None:
            layout = self.local_layout
            regions = layout.targets(group) if layout.uses_group_mapping else slice(None)
            got = self._id_bytes[group] = int(self.block_lens[regions].sum())
        return got

    def read_ids(
        self,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
    ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Paired (local, remote) descriptor ids and the bytes they move, or None when the
        request needs the general planner (group counts differ, ids that are not integers,
        or a group where the decode holds more pages than the prefill sent).

        Raises:
            BlockIdRangeError / GroupLayoutError: as ``plan_read_ids`` for the same ids.
        """
        if len(local_block_ids) != len(remote_block_ids):
            return None
        if self._one_group is not None and len(local_block_ids) == 1:
            got = self._one_group_ids(local_block_ids[0], remote_block_ids[0])
            if got is not None:
                return got
        local: list[np.ndarray] = []
        remote: list[np.ndarray] = []
        for lg, rg in zip(local_block_ids, remote_block_ids, strict=True):
            d = _kernel_ids(lg, self.local_ppl)
            p = _kernel_ids(rg, self.remote_ppl)
            if d is None or p is None or d.size > p.size:
                return None
            local.append(d)
            remote.append(p[p.size - d.size:])
        lids = self.local_layout.desc_ids(local)
        rids = self.remote_layout.desc_ids(remote)
        if lids.size != rids.size:
            return None
        nbytes = sum(d.size * self.id_bytes(g) for g, d in enumerate(local) if d.size)
        return lids, rids, nbytes


    def _one_group_ids(self, lg: Sequence[int], rg: Sequence[int]
                       ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """:meth:`read_ids` for one group at ppl 1: the columns of the request's blocks in
        the two id tables, region by region (so blocks adjacent in a region stay adjacent,
        and NIXL can merge them). The ids come out int32, NIXL's index type, so nothing
        converts them again. None (the general path decides, and raises what it raises) for
        anything else: other types, no ids, ids out of range."""
        ltable, rtable, id_bytes = self._one_group  # type: ignore[misc]
        lcap, rcap = ltable.shape[1], rtable.shape[1]
        if type(lg) is list and type(rg) is list:   # what vLLM's scheduler hands over
            n = len(lg)
            if not 0 < n <= len(rg):
                return None
            p = rg[len(rg) - n:] if n != len(rg) else rg
            try:
                if min(lg) < 0 or max(lg) >= lcap or min(p) < 0 or max(p) >= rcap:
                    return None
            except TypeError:                       # not numbers
                return None
            d = np.asarray(lg)
            q = np.asarray(p)
            if d.dtype.kind != "i" or q.dtype.kind != "i":     # bools, floats: not ids
                return None
        else:
            d = lg if type(lg) is np.ndarray else np.asarray(lg)
            q = rg if type(rg) is np.ndarray else np.asarray(rg)
            if (d.ndim != 1 or q.ndim != 1 or d.dtype.kind != "i" or q.dtype.kind != "i"
                    or not 0 < d.size <= q.size):
                return None
            d = d.astype(np.int64, copy=False)
            q = q[q.size - d.size:].astype(np.int64, copy=False)
            # as uint64 a negative id is huge: one reduction checks both bounds
            if int(_max(d.view(_U64))) >= lcap or int(_max(q.view(_U64))) >= rcap:
                return None
        return (ltable.take(d, 1).ravel(), rtable.take(q, 1).ravel(), int(d.size) * id_bytes)


_U64 = np.dtype(np.uint64)
_max = np.maximum.reduce


def _kernel_ids(block_ids: Sequence[int], ppl: int) -> np.ndarray | None:
    """Logical ids as int64 kernel ids (``b*ppl + j``); None if they are not integers."""
    ids = np.asarray(block_ids)
    if ids.size == 0:
        return np.empty(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind != "i":
        return None
    ids = ids.astype(np.int64, copy=False)
    if ppl == 1:
        return ids
    return np.add.outer(ids * ppl, np.arange(ppl, dtype=np.int64)).ravel()
