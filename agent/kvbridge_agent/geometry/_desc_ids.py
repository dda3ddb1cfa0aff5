"""Descriptor-id computation (spec §3): block ids -> positions in a prepared dlist.

:class:`DescIdLayout` validates and precomputes one engine's region layout (capacities,
offsets, group targets) once; :meth:`DescIdLayout.desc_ids` is the per-request hot path.
:func:`compute_desc_ids` is the one-shot form of the two: it first tries a lean path
(:func:`_one_shot`) that validates with as few numpy passes as possible and builds no
layout object; whenever that path sees anything unusual (an error, an odd type, a layout it
does not fast-path) it steps aside and the full ``DescIdLayout`` path runs, so every error
is raised by the same code with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._descriptors import capacity_offsets
from ._errors import BlockIdRangeError, GeometryError, GroupLayoutError
from ._ids import as_id_lists, empty_ids, region_label

__all__ = ["DescIdLayout", "compute_desc_ids"]

# Above this many non-empty groups, validation is done for all groups in one pass.
_VECTOR_GROUPS = 4
# Group ids index kv_cache_config.transfer_groups; anything this large is corrupt metadata.
_MAX_GROUPS = 1 << 16
#: "smallest capacity" of a group no region belongs to (it is refused before use)
_NO_CAPACITY = np.iinfo(np.int64).max
_U64 = np.dtype(np.uint64)
_I32_MAX = 2**31 - 1    # NIXL's descriptor index is int32
_max = np.maximum.reduce


def _capacities(region_num_blocks, region_group_ids, k: int | None):
    caps = np.asarray(region_num_blocks)
    gids = np.asarray(region_group_ids)
    if caps.ndim != 1 or gids.ndim != 1:
        raise GroupLayoutError(
            "region_num_blocks and region_group_ids must be flat per-region lists, got "
            f"shapes {caps.shape} and {gids.shape}"
        )
    if caps.size and caps.dtype.kind not in "iu":
        raise GeometryError(f"region_num_blocks must hold integers, got dtype {caps.dtype}")
    if gids.size and gids.dtype.kind not in "iu":
        raise GroupLayoutError(f"region_group_ids must hold integers, got dtype {gids.dtype}")
    caps = caps.astype(np.int64)
    gids = gids.astype(np.int64)
    if caps.shape != gids.shape:
        raise GroupLayoutError(
            f"region_num_blocks has {caps.size} entries but region_group_ids has "
            f"{gids.size}; both need one entry per region"
        )
    if caps.size and caps.min() < 0:
        r = int(np.argmin(caps))
        raise GeometryError(f"region_num_blocks[{r}] must be >= 0, got {int(caps[r])}")
    if gids.size and gids.min() < -1:
        r = int(np.argmin(gids))
        raise GroupLayoutError(
            f"region_group_ids[{r}] must be a group index or -1 (shared), got {int(gids[r])}"
        )
    if gids.size and gids.max() >= _MAX_GROUPS:
        r = int(np.argmax(gids))
        raise GroupLayoutError(
            f"region_group_ids[{r}] is {int(gids[r])}: group ids index the transfer groups "
            f"and must be below {_MAX_GROUPS}"
        )
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise GeometryError(f"block_size_ratio must be None or an int >= 1, got {k!r}")
        caps = caps * int(k)
    return caps, gids


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class DescIdLayout:
    """One engine's region layout for descriptor ids, validated and precomputed once.

    ``capacities`` are the effective per-region capacities (× ``block_size_ratio`` k when
    given), ``offsets`` their exclusive prefix sum (region r starts at ``offsets[r]``).
    ``uses_group_mapping`` defaults to "more than one distinct group id" (spec §3.2–§3.4).
    Build it with the same arguments as :func:`compute_desc_ids`; it is immutable and may
    be shared between threads.
    """

    __slots__ = (
        "_id_table",
        "_min_cap",
        "_n_groups",
        "_slot_plan",
        "_tables",
        "_targets",
        "block_size_ratio",
        "capacities",
        "group_ids",
        "offsets",
        "region_names",
        "uses_group_mapping",
    )

    def __init__(
        self,
        region_num_blocks: Sequence[int] | np.ndarray,
        region_group_ids: Sequence[int] | np.ndarray,
        *,
        uses_group_mapping: bool | None = None,
        block_size_ratio: int | None = None,
        region_names: Sequence[str] | None = None,
    ) -> None:
        _set = object.__setattr__
        caps, gids = _capacities(region_num_blocks, region_group_ids, block_size_ratio)
        _set(self, "capacities", _readonly(caps))
        _set(self, "group_ids", _readonly(gids))
        _set(self, "offsets", _readonly(capacity_offsets(caps)))
        if uses_group_mapping is None:
            uses_group_mapping = gids.size > 0 and bool((gids != gids[0]).any())
        _set(self, "uses_group_mapping", bool(uses_group_mapping))
        _set(self, "block_size_ratio", block_size_ratio)
        _set(self, "region_names", tuple(region_names) if region_names is not None else None)
        _set(self, "_min_cap", int(caps.min()) if caps.size else 0)
        _set(self, "_n_groups", int(gids.max()) + 1 if gids.size else 0)

        _set(self, "_tables", None)  # group tables, built on the first group-mapped call
        _set(self, "_targets", {})  # group -> target regions, filled on first use
        _set(self, "_slot_plan", {})  # slot -> (n_targets, min capacity, target offsets)
        _set(self, "_id_table", None)  # the fast path's ids as a table, built on first use

    def _group_tables(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(G, n_targets, smallest target capacity, single target or -1) per group slot.

        Slots 0..G-1 are the group ids present; slot G stands for any larger id (those
        reach only the shared regions).
        """
        tables = self._tables
        if tables is not None:
            return tables
        caps, gids = self.capacities, self.group_ids
        n_groups = int(gids.max()) + 1 if gids.size else 0
        shared = gids == -1
        own = ~shared
        big = np.iinfo(np.int64).max
        counts = np.bincount(gids[own], minlength=n_groups)
        own_min = np.full(n_groups, big, dtype=np.int64)
        np.minimum.at(own_min, gids[own], caps[own])
        own_idx = np.full(n_groups, -1, dtype=np.int64)
        own_idx[gids[own]] = np.flatnonzero(own)  # exact where counts == 1
        n_shared = int(shared.sum())
        shared_min = int(caps[shared].min()) if n_shared else big
        shared_idx = int(np.flatnonzero(shared)[0]) if n_shared == 1 else -1
        n_targets = np.append(counts + n_shared, n_shared)
        single = np.full(n_groups + 1, -1, dtype=np.int64)
        single[:-1] = np.where((counts == 1) & (n_shared == 0), own_idx, -1)
        single[np.append(counts == 0, True) & (n_shared == 1)] = shared_idx
        group_min = np.minimum(np.append(own_min, big), shared_min)
        tables = (n_groups, _readonly(n_targets), _readonly(group_min), _readonly(single))
        object.__setattr__(self, "_tables", tables)  # idempotent: a race builds the same
        return tables

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"DescIdLayout is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        return (
            f"DescIdLayout(regions={self.capacities.size}, "
            f"uses_group_mapping={self.uses_group_mapping}, "
            f"block_size_ratio={self.block_size_ratio})"
        )

    def id_table(self) -> np.ndarray | None:
        """The fast path's ids as a (regions, smallest capacity) int32 table: row r, column b
        is the descriptor id of block b in region r, so the columns of a request's blocks,
        read row by row, are its ids in ``desc_ids`` order. One ``take`` of them costs about
        a third of a broadcast add per call (``nixl.ReadRoute`` uses it per request); 4
        bytes per descriptor, built on first use. None for a group-mapped layout, without
        regions, or when an id would not fit int32 (NIXL's index type)."""
        table = self._id_table
        if table is None:
            if (self.uses_group_mapping or not self.capacities.size
                    or int(self.offsets[-1]) + self._min_cap - 1 > _I32_MAX):
                return None
            table = _readonly(np.add.outer(self.offsets.astype(np.int32),
                                           np.arange(self._min_cap, dtype=np.int32)))
            object.__setattr__(self, "_id_table", table)  # idempotent: a race builds the same
        return table

    def targets(self, group: int) -> np.ndarray:
        """Regions that group ``group``'s ids go to on the group-mapped path, ascending."""
        slot = min(group, self._n_groups)
        t = self._targets.get(slot)
        if t is None:
            t = _readonly(np.flatnonzero((self.group_ids == slot) | (self.group_ids == -1)))
            self._targets[slot] = t
        return t

    def _range_error(self, ids: np.ndarray, targets: np.ndarray, group: int | None):
        caps = self.capacities[targets]
        lo, hi = int(ids.min()), int(ids.max())
        i = int(np.argmax((caps <= hi) | (lo < 0)))
        r, cap = int(targets[i]), int(caps[i])
        bad = ids[(ids < 0) | (ids >= cap)]
        who = f"group {group}" if group is not None else "the request"
        k = self.block_size_ratio
        unit = f"descriptors at block_size_ratio {k}" if k else "blocks"
        return BlockIdRangeError(
            f"block id {int(bad[0])} of {who} is out of range for "
            f"{region_label(r, self.region_names)}: capacity {cap} {unit} "
            f"(valid ids 0..{cap - 1}); {bad.size} id(s) out of range"
        )

    def desc_ids(self, block_ids: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """Descriptor ids (int64) for one request's per-group (or per-region) block ids.

        See :func:`compute_desc_ids` for the semantics and the errors raised.
        """
        entries = as_id_lists(block_ids, "block_ids")
        if not self.uses_group_mapping:
            if len(entries) == 1:
                flat = entries[0]
            else:
                flat = np.concatenate(entries) if entries else empty_ids()
            if flat.size == 0:
                return empty_ids()
            if self.capacities.size == 0:
                raise GroupLayoutError(
                    f"block_ids has {flat.size} block id(s) but there are no regions"
                )
            # as uint64 a negative id is huge: one pass checks both bounds
            if int(_max(flat.view(_U64))) >= self._min_cap:
                raise self._range_error(flat, np.arange(self.capacities.size), None)
            return np.add.outer(self.offsets, flat).ravel()
        return self._group_mapped(entries)

    def _slot(self, group: int) -> tuple[int, int, np.ndarray]:
        """(number of target regions, their smallest capacity, their offsets) of a group."""
        slot = min(group, self._n_groups)
        entry = self._slot_plan.get(slot)
        if entry is None:   # from this group's targets alone: a one-shot call builds no tables
            targets = self.targets(group)
            smallest = int(self.capacities[targets].min()) if targets.size else _NO_CAPACITY
            entry = (int(targets.size), smallest, _readonly(self.offsets[targets]))
            self._slot_plan[slot] = entry
        return entry

    def _few_groups(self, entries: list[np.ndarray]) -> np.ndarray:
        """The group-mapped path for a handful of groups: cached per-group plans, one bound
        check per group, one output allocation (same checks and order as the general path)."""
        live = [g for g, e in enumerate(entries) if e.size]
        if not live:
            return empty_ids()
        slots = [self._slot(g) for g in live]
        for g, (n_targets, _, _) in zip(live, slots, strict=True):
            if n_targets == 0:
                raise GroupLayoutError(
                    f"group {g} has {entries[g].size} block id(s) but no region belongs "
                    f"to it (region group ids: {self.group_ids.tolist()})"
                )
        total = 0
        for g, (_, min_cap, offs) in zip(live, slots, strict=True):
            ids = entries[g]
            # as uint64 a negative id is huge: one pass checks both bounds
            if int(_max(ids.view(_U64))) >= min_cap:
                raise self._range_error(ids, self.targets(g), g)
            total += offs.size * ids.size
        if len(live) == 1:
            return np.add.outer(slots[0][2], entries[live[0]]).ravel()
        out = np.empty(total, dtype=np.int64)
        pos = 0
        for g, (_, _, offs) in zip(live, slots, strict=True):
            ids = entries[g]
            n = offs.size * ids.size
            np.add(offs[:, None], ids[None, :], out=out[pos : pos + n].reshape(offs.size, -1))
            pos += n
        return out

    def _group_mapped(self, entries: list[np.ndarray]) -> np.ndarray:
        if len(entries) <= _VECTOR_GROUPS:
            return self._few_groups(entries)
        lens = np.fromiter((e.size for e in entries), np.int64, len(entries))
        live = np.flatnonzero(lens)
        if live.size == 0:
            return empty_ids()
        n_groups, n_targets, group_min, single = self._group_tables()
        slots = np.minimum(live, n_groups)
        orphan = np.flatnonzero(n_targets[slots] == 0)
        if orphan.size:
            g = int(live[orphan[0]])
            raise GroupLayoutError(
                f"group {g} has {entries[g].size} block id(s) but no region belongs "
                f"to it (region group ids: {self.group_ids.tolist()})"
            )
        live_list = live.tolist()
        if live.size <= _VECTOR_GROUPS:
            for g, min_cap in zip(live_list, group_min[slots].tolist(), strict=True):
                ids = entries[g]
                if int(ids.min()) < 0 or int(ids.max()) >= min_cap:
                    raise self._range_error(ids, self.targets(g), g)
        else:
            flat = np.concatenate([entries[g] for g in live_list])
            live_lens = lens[live]
            starts = capacity_offsets(live_lens)
            bad = (np.minimum.reduceat(flat, starts) < 0) | (
                np.maximum.reduceat(flat, starts) >= group_min[slots]
            )
            if bad.any():
                g = live_list[int(np.argmax(bad))]
                raise self._range_error(entries[g], self.targets(g), g)
            singles = single[slots]
            if (singles >= 0).all():
                # one region per group (the region-mapped call): ids keep their order;
                # equal lists (the usual case) broadcast in place instead of repeating
                if int(live_lens.min()) == int(live_lens.max()):
                    rows = flat.reshape(live_lens.size, -1)
                    rows += self.offsets[singles][:, None]
                    return flat
                return flat + np.repeat(self.offsets[singles], live_lens)
        out = np.empty(int((lens[live] * n_targets[slots]).sum()), dtype=np.int64)
        pos = 0
        for g in live_list:
            ids = entries[g]
            offs = self.offsets[self.targets(g)]
            n = offs.size * ids.size
            np.add(offs[:, None], ids[None, :], out=out[pos : pos + n].reshape(offs.size, -1))
            pos += n
        return out


def compute_desc_ids(
    block_ids: Sequence[Sequence[int] | np.ndarray],
    region_num_blocks: Sequence[int] | np.ndarray,
    region_group_ids: Sequence[int] | np.ndarray,
    *,
    uses_group_mapping: bool | None = None,
    block_size_ratio: int | None = None,
    region_names: Sequence[str] | None = None,
) -> np.ndarray:
    """Turn per-group block ids into descriptor ids of a region-major dlist (spec §3).

    ``block_ids`` holds one list per transfer group (or one per region for a region-mapped
    call, with ``region_group_ids = range(R)``). Ids are kernel ids; with
    ``block_size_ratio`` k they are already sub-block ids and every capacity is multiplied
    by k. Region r starts at ``O[r]``, the exclusive prefix sum of the capacities.

    - Fast path (``uses_group_mapping`` false; default: at most one distinct group id):
      every region receives all entries' ids concatenated, region-major.
    - Group-mapped path: entry g goes to the regions whose group id is g or -1, in region
      order; entries are emitted in order. An empty entry emits nothing.

    Returns an int64 array. Raises :class:`GroupLayoutError` when the per-region arrays
    disagree or a non-empty group has no region, and :class:`BlockIdRangeError` when an id
    is negative or not below the capacity of a region it targets (both naming the group
    and region; ``region_names`` adds layer names to messages). For repeated calls on one
    layout, build a :class:`DescIdLayout` once and call its ``desc_ids``.
    """
    layout = DescIdLayout(
        region_num_blocks,
        region_group_ids,
        uses_group_mapping=uses_group_mapping,
        block_size_ratio=block_size_ratio,
        region_names=region_names,
    )
    return layout.desc_ids(block_ids)
