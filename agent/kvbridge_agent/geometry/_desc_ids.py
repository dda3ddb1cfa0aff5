"""Descriptor-id computation (spec §3): block ids -> positions in a prepared dlist."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._descriptors import capacity_offsets
from ._errors import BlockIdRangeError, GeometryError, GroupLayoutError
from ._ids import as_id_lists, empty_ids, region_label

__all__ = ["compute_desc_ids"]


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
    caps = caps.astype(np.int64, copy=False)
    gids = gids.astype(np.int64, copy=False)
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


def _range_error(
    ids: np.ndarray,
    cap: int,
    region: int,
    group: int | None,
    names: Sequence[str] | None,
    k: int | None,
) -> BlockIdRangeError:
    bad = ids[(ids < 0) | (ids >= cap)]
    who = f"group {group}" if group is not None else "the request"
    unit = f"descriptors at block_size_ratio {k}" if k else "blocks"
    return BlockIdRangeError(
        f"block id {int(bad[0])} of {who} is out of range for "
        f"{region_label(region, names)}: capacity {cap} {unit} "
        f"(valid ids 0..{cap - 1}); {bad.size} id(s) out of range"
    )


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
    and region; ``region_names`` adds layer names to messages).
    """
    caps, gids = _capacities(region_num_blocks, region_group_ids, block_size_ratio)
    entries = as_id_lists(block_ids, "block_ids")
    offsets = capacity_offsets(caps)
    if uses_group_mapping is None:
        uses_group_mapping = gids.size > 0 and bool((gids != gids[0]).any())

    if not uses_group_mapping:
        flat = entries[0] if len(entries) == 1 else (
            np.concatenate(entries) if entries else empty_ids()
        )
        if flat.size == 0:
            return empty_ids()
        if caps.size == 0:
            raise GroupLayoutError(
                f"block_ids has {flat.size} block id(s) but there are no regions"
            )
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= int(caps.min()):
            r = int(np.argmax((caps <= hi) | (lo < 0)))
            raise _range_error(flat, int(caps[r]), r, None, region_names, block_size_ratio)
        return np.add.outer(offsets, flat).ravel()

    parts = []
    shared = gids == -1
    for g, ids in enumerate(entries):
        if ids.size == 0:
            continue
        targets = np.flatnonzero((gids == g) | shared)
        if targets.size == 0:
            raise GroupLayoutError(
                f"group {g} has {ids.size} block id(s) but no region belongs to it "
                f"(region group ids: {gids.tolist()})"
            )
        lo, hi = int(ids.min()), int(ids.max())
        tcaps = caps[targets]
        if lo < 0 or hi >= int(tcaps.min()):
            i = int(np.argmax((tcaps <= hi) | (lo < 0)))
            raise _range_error(
                ids, int(tcaps[i]), int(targets[i]), g, region_names, block_size_ratio
            )
        parts.append(np.add.outer(offsets[targets], ids).ravel())
    if not parts:
        return empty_ids()
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
