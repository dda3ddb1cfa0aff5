"""Per-region expansion and prefix alignment of request block ids (spec §3.6, §3.7, §4.3, §4.4).

All functions take and return block-id lists as int64 numpy arrays (lists are accepted on
input) and never loop over blocks in Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import GeometryError, GroupLayoutError, PrefixAlignmentError
from ._ids import as_id_lists, as_ids, empty_ids, region_label

__all__ = [
    "align_prefix_by_group",
    "align_prefix_by_region",
    "block_ids_by_region",
    "expand_logical_to_kernel",
    "map_to_sub_blocks",
]

IdLists = Sequence[Sequence[int] | np.ndarray]


def block_ids_by_region(
    block_ids: IdLists,
    region_group_ids: Sequence[int] | np.ndarray,
    *,
    region_names: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """One block-id list per region, in region order (spec §4.3).

    A region of group g >= 0 gets a copy of ``block_ids[g]``; a shared region (-1) gets
    every group's ids concatenated in group order. Raises :class:`GroupLayoutError` when a
    region names a group that ``block_ids`` does not have, or a group id below -1.
    """
    groups = as_id_lists(block_ids, "block_ids")
    gids = [int(g) for g in np.asarray(region_group_ids).tolist()]
    out: list[np.ndarray] = []
    shared: np.ndarray | None = None
    for r, g in enumerate(gids):
        if g == -1:
            if shared is None:
                shared = np.concatenate(groups) if groups else empty_ids()
            out.append(shared.copy())
        elif 0 <= g < len(groups):
            out.append(groups[g].copy())
        else:
            raise GroupLayoutError(
                f"{region_label(r, region_names)} belongs to group {g}, but block_ids has "
                f"{len(groups)} group list(s)"
            )
    return out


def align_prefix_by_region(
    decode: IdLists,
    prefill: IdLists,
    *,
    num_computed_blocks: Sequence[int] | np.ndarray | None = None,
    num_remote_blocks: int | None = None,
    region_names: Sequence[str] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Pair D's and P's per-region kernel ids for a region-mapped read (spec §4.4).

    Returns ``(local, remote)`` per-region lists of equal lengths. If D has no blocks at
    all, both are lists of empty arrays (notify-only).

    - Suffix rule (default): D keeps its list and pairs with the last ``len(D_r)`` pages of
      P's list. D having more pages than P raises :class:`PrefixAlignmentError`.
    - Positional rule (``num_computed_blocks`` and ``num_remote_blocks`` given): with
      ``start = num_computed_blocks[r]`` and
      ``count = min(len(D_r), max(num_remote_blocks - start, 0))``, D keeps its first
      ``count`` pages, paired with P's pages ``[start, start + count)``; P's list not
      covering a non-empty range raises :class:`PrefixAlignmentError`.
    """
    d = as_id_lists(decode, "decode")
    p = as_id_lists(prefill, "prefill")
    if len(d) != len(p):
        raise PrefixAlignmentError(
            f"decode has {len(d)} region list(s) but prefill has {len(p)}; "
            "both need one list per region"
        )
    positional = num_computed_blocks is not None
    if positional != (num_remote_blocks is not None):
        raise PrefixAlignmentError(
            "num_computed_blocks and num_remote_blocks must be given together "
            f"(got num_computed_blocks={'set' if positional else None}, "
            f"num_remote_blocks={num_remote_blocks!r})"
        )
    if not any(x.size for x in d):
        return [empty_ids() for _ in d], [empty_ids() for _ in p]

    local: list[np.ndarray] = []
    remote: list[np.ndarray] = []
    if not positional:
        for r, (dr, pr) in enumerate(zip(d, p, strict=True)):
            if dr.size > pr.size:
                raise PrefixAlignmentError(
                    f"{region_label(r, region_names)}: decode allocated more KV pages "
                    f"({dr.size}) than the prefill worker supplied ({pr.size})"
                )
            local.append(dr)
            remote.append(pr[pr.size - dr.size :] if dr.size else empty_ids())
        return local, remote

    starts = np.asarray(num_computed_blocks)
    if starts.shape != (len(d),):
        raise PrefixAlignmentError(
            f"num_computed_blocks has shape {starts.shape}, expected one entry per region "
            f"({len(d)})"
        )
    if starts.size and (starts.dtype.kind not in "iu" or starts.min() < 0):
        raise PrefixAlignmentError(
            f"num_computed_blocks must hold ints >= 0, got {starts.tolist()}"
        )
    if isinstance(num_remote_blocks, bool) or not isinstance(
        num_remote_blocks, int | np.integer
    ) or num_remote_blocks < 0:
        raise PrefixAlignmentError(
            f"num_remote_blocks must be an int >= 0, got {num_remote_blocks!r}"
        )
    for r, (dr, pr) in enumerate(zip(d, p, strict=True)):
        start = int(starts[r])
        count = min(dr.size, max(int(num_remote_blocks) - start, 0))
        if count and pr.size < start + count:  # an empty range is trivially covered
            raise PrefixAlignmentError(
                f"{region_label(r, region_names)}: remote KV pages do not cover the "
                f"requested range [{start}, {start + count}) (prefill supplied {pr.size})"
            )
        local.append(dr[:count])
        remote.append(pr[start : start + count])
    return local, remote


def align_prefix_by_group(
    decode: IdLists,
    prefill: IdLists,
    *,
    max_padding: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """End-trim per-group lists for a group-matched read (spec §4.4 last paragraph, §5).

    Per group: when D has fewer pages (local prefix hit), P keeps its last ``len(D)``
    pages; when D has more (rounding padding with different ppl), D keeps its first
    ``len(P)`` pages. ``max_padding`` (e.g. ``ppl_D + ppl_P``) bounds that excess; beyond it
    :class:`PrefixAlignmentError` is raised. Group counts must match.
    """
    d = as_id_lists(decode, "decode")
    p = as_id_lists(prefill, "prefill")
    if len(d) != len(p):
        raise PrefixAlignmentError(
            f"decode has {len(d)} group list(s) but prefill has {len(p)}; "
            "both need one list per transfer group"
        )
    local: list[np.ndarray] = []
    remote: list[np.ndarray] = []
    for g, (dg, pg) in enumerate(zip(d, p, strict=True)):
        if dg.size <= pg.size:
            local.append(dg)
            remote.append(pg[pg.size - dg.size :] if dg.size else empty_ids())
            continue
        excess = dg.size - pg.size
        if max_padding is not None and excess > max_padding:
            raise PrefixAlignmentError(
                f"group {g}: decode allocated {dg.size} KV pages but the prefill worker "
                f"supplied {pg.size}; the excess {excess} exceeds max_padding {max_padding}"
            )
        local.append(dg[: pg.size])
        remote.append(pg)
    return local, remote


def expand_logical_to_kernel(block_ids: Sequence[int] | np.ndarray, ppl: int) -> np.ndarray:
    """Logical block b -> kernel blocks ``b*ppl + j`` for j in 0..ppl-1 (spec §3.7)."""
    if isinstance(ppl, bool) or not isinstance(ppl, int | np.integer) or ppl < 1:
        raise GeometryError(f"ppl (physical blocks per logical block) must be >= 1, got {ppl!r}")
    ids = as_ids(block_ids, "block_ids")
    if ppl == 1:
        return ids.copy()
    return np.add.outer(ids * int(ppl), np.arange(int(ppl), dtype=np.int64)).ravel()


def map_to_sub_blocks(
    block_ids: Sequence[int] | np.ndarray,
    block_size_ratio: int,
    remote_count: int | None = None,
) -> np.ndarray:
    """Local block b -> sub-blocks ``b*k + s`` for s < k, clipped to ``remote_count`` (§3.6).

    The first ``remote_count`` sub-block ids are kept (the remote kernel blocks that
    exist); the uncovered tail of the last local block is the receiver's to zero.
    Raises :class:`PrefixAlignmentError` if ``remote_count`` exceeds the sub-blocks.
    """
    k = block_size_ratio
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise GeometryError(f"block_size_ratio must be an int >= 1, got {k!r}")
    ids = as_ids(block_ids, "block_ids")
    out = ids.copy() if k == 1 else np.add.outer(ids * int(k), np.arange(int(k))).ravel()
    if remote_count is None:
        return out
    if remote_count < 0 or remote_count > out.size:
        raise PrefixAlignmentError(
            f"remote_count {remote_count} is outside [0, {out.size}]: {ids.size} local "
            f"block(s) hold {out.size} sub-blocks at block_size_ratio {k}"
        )
    return out[:remote_count]
