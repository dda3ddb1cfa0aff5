"""Descriptor-id computation (spec §3): block ids -> positions in a prepared dlist.

:class:`DescIdLayout` validates and precomputes one engine's region layout (capacities,
offsets, group targets) once; :meth:`DescIdLayout.desc_ids` is the per-request hot path.
:func:`compute_desc_ids` is the one-shot form of the two.
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
    Build it with the same arguments as :func:`compute_desc_ids`; it is immutable.
    """

    __slots__ = (
        "_max_gid",
        "_min_cap",
        "_shared",
        "_shared_min",
        "_single",
        "_targets",
        "_targets_min",
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
        shared = gids == -1
        _set(self, "_shared", _readonly(np.flatnonzero(shared)))
        _set(self, "_shared_min", int(caps[shared].min()) if shared.any() else 0)
        _set(self, "_max_gid", int(gids.max()) if gids.size else -1)
        targets, mins, single = [], [], []
        for g in range(self._max_gid + 1):
            t = _readonly(np.flatnonzero((gids == g) | shared))
            targets.append(t)
            mins.append(int(caps[t].min()) if t.size else 0)
            single.append(int(t[0]) if t.size == 1 else -1)
        _set(self, "_targets", tuple(targets))
        _set(self, "_targets_min", tuple(mins))
        _set(self, "_single", tuple(single))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"DescIdLayout is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        return (
            f"DescIdLayout(regions={self.capacities.size}, "
            f"uses_group_mapping={self.uses_group_mapping}, "
            f"block_size_ratio={self.block_size_ratio})"
        )

    def _group(self, g: int) -> tuple[np.ndarray, int, int]:
        """(target regions, their smallest capacity, the region if exactly one else -1)."""
        if g <= self._max_gid:
            return self._targets[g], self._targets_min[g], self._single[g]
        t = self._shared
        return t, self._shared_min, int(t[0]) if t.size == 1 else -1

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
            if int(flat.min()) < 0 or int(flat.max()) >= self._min_cap:
                raise self._range_error(flat, np.arange(self.capacities.size), None)
            return np.add.outer(self.offsets, flat).ravel()
        return self._group_mapped(entries)

    def _group_mapped(self, entries: list[np.ndarray]) -> np.ndarray:
        live = [g for g, e in enumerate(entries) if e.size]
        if not live:
            return empty_ids()
        groups = [self._group(g) for g in live]
        for g, (targets, _, _) in zip(live, groups, strict=True):
            if targets.size == 0:
                raise GroupLayoutError(
                    f"group {g} has {entries[g].size} block id(s) but no region belongs "
                    f"to it (region group ids: {self.group_ids.tolist()})"
                )
        if len(live) <= _VECTOR_GROUPS:
            for g, (targets, min_cap, _) in zip(live, groups, strict=True):
                ids = entries[g]
                if int(ids.min()) < 0 or int(ids.max()) >= min_cap:
                    raise self._range_error(ids, targets, g)
            flat = None
        else:
            flat = np.concatenate([entries[g] for g in live])
            lens = np.fromiter((entries[g].size for g in live), np.int64, len(live))
            starts = capacity_offsets(lens)
            min_caps = np.fromiter((m for _, m, _ in groups), np.int64, len(live))
            bad = (np.minimum.reduceat(flat, starts) < 0) | (
                np.maximum.reduceat(flat, starts) >= min_caps
            )
            if bad.any():
                i = int(np.argmax(bad))
                raise self._range_error(entries[live[i]], groups[i][0], live[i])
            if all(s >= 0 for _, _, s in groups):
                # one region per group (the region-mapped call): ids keep their order
                singles = np.fromiter((s for _, _, s in groups), np.int64, len(live))
                return flat + np.repeat(self.offsets[singles], lens)
        total = sum(t.size * entries[g].size for g, (t, _, _) in zip(live, groups, strict=True))
        out = np.empty(total, dtype=np.int64)
        pos = 0
        for g, (targets, _, _) in zip(live, groups, strict=True):
            ids = entries[g]
            n = targets.size * ids.size
            np.add(
                self.offsets[targets][:, None],
                ids[None, :],
                out=out[pos : pos + n].reshape(targets.size, ids.size),
            )
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
