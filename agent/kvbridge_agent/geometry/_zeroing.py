"""Byte ranges a receiver must zero after a successful pull (spec §4.9, invariant §6.3.8).

The scheduler does not zero the blocks it allocates for incoming KV (that would race the
RDMA write), so everything the receiver allocated for a request but did not read must be
zeroed by the receiver once the read is complete: the tail sub-blocks of the last partly
covered local block when ``block_size_ratio`` k > 1, whole kernel blocks clipped by ppl
rounding or prefix-alignment padding, and per-region allocation padding of the positional
region-mapped rule. All of these are descriptors of the local list (at ratio k) that the
request owns but whose id is not among the READ's local ids, so one function covers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._descriptors import capacity_offsets
from ._errors import BlockIdRangeError, GeometryError
from ._ids import as_ids
from ._regions import RegionPlan

__all__ = ["untransferred_ranges"]

_U64 = np.uint64


def untransferred_ranges(
    plan: RegionPlan,
    allocated_ids: Sequence[int] | np.ndarray,
    transferred_ids: Sequence[int] | np.ndarray,
    block_size_ratio: int = 1,
) -> dict[str, np.ndarray]:
    """Byte ranges of local descriptors ``allocated_ids`` that are not in ``transferred_ids``.

    Both id arrays are positions in the local descriptor list of ``plan`` at ratio
    ``block_size_ratio`` k (the region-major list of ``local_descriptor_table(plan, k)``;
    the ids ``compute_desc_ids`` returns for the local side). ``allocated_ids`` are every
    descriptor the request owns (its full local block lists, unclipped, mapped to all k
    sub-blocks); ``transferred_ids`` the local ids of the READ. Descriptor ``d`` of region
    r covers ``[base_r + b*stride_r + s*len_r/k, +len_r/k)`` with ``b, s = divmod(d - O[r],
    k)`` (spec §3.10); the gap between ``block_len`` and ``block_stride`` is never included.

    Returns ``{mem_type: rows}`` for each memory type with something to zero, where rows is
    an (N, 3) uint64 array of ``(addr, nbytes, device_id)`` sorted by (device, addr), with
    ranges adjacent in memory (same type and device) merged into one. Duplicate ids are
    allowed. Raises :class:`BlockIdRangeError` for an id outside the list and
    :class:`GeometryError` when k is not an int >= 1 or does not divide a region's
    ``block_len``.
    """
    k = block_size_ratio
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise GeometryError(f"block_size_ratio must be an int >= 1, got {k!r}")
    k = int(k)
    alloc = as_ids(allocated_ids, "allocated_ids")
    done = as_ids(transferred_ids, "transferred_ids")
    caps = plan.region_num_blocks * k
    total = int(caps.sum())
    for name, ids in (("allocated_ids", alloc), ("transferred_ids", done)):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= total):
            bad = ids[(ids < 0) | (ids >= total)]
            raise BlockIdRangeError(
                f"{name}: descriptor id {int(bad[0])} is outside the local list of "
                f"{total} descriptors at block_size_ratio {k}; {bad.size} id(s) out of range"
            )
    if alloc.size == 0:
        return {}
    lens = plan.block_lens
    bad_len = np.flatnonzero(lens % k)
    if bad_len.size:
        r = int(bad_len[0])
        raise GeometryError(
            f"region {r} ({plan.names[r]!r}): block_len {int(lens[r])} is not divisible "
            f"by block_size_ratio {k}"
        )
    left = np.setdiff1d(alloc, done) if done.size else np.unique(alloc)
    if left.size == 0:
        return {}

    offsets = capacity_offsets(caps)
    region = np.searchsorted(offsets, left, side="right") - 1
    within = left - offsets[region]
    sub = (lens // k).astype(_U64)
    addr = plan.addrs[region] + (within // k).astype(_U64) * plan.block_strides.astype(
        _U64)[region]
    if k > 1:
        addr += (within % k).astype(_U64) * sub[region]
    nbytes = sub[region]
    types = sorted(set(plan.mem_types))
    code = np.array([types.index(m) for m in plan.mem_types], dtype=np.int64)[region]
    dev = plan.device_ids[region]

    order = np.lexsort((addr, dev, code))
    addr, nbytes, dev, code = addr[order], nbytes[order], dev[order], code[order]
    starts = np.ones(addr.size, dtype=bool)
    starts[1:] = (code[1:] != code[:-1]) | (dev[1:] != dev[:-1]) | (
        addr[1:] != addr[:-1] + nbytes[:-1])
    first = np.flatnonzero(starts)
    rows = np.empty((first.size, 3), dtype=_U64)
    rows[:, 0] = addr[first]
    rows[:, 1] = np.add.reduceat(nbytes, first)
    rows[:, 2] = dev[first].astype(_U64)
    run_code = code[first]
    out: dict[str, np.ndarray] = {}
    for i, mem_type in enumerate(types):
        sel = run_code == i
        if sel.any():
            out[mem_type] = rows[sel]
    return out
