"""Local and remote descriptor tables (spec §2.7), as (N, 3) uint64 arrays.

Row ``j`` is ``(addr, len, device_id)`` of descriptor ``j``: exactly the tuples a NIXL
``prep_xfer_dlist`` takes. Tables are region-major and built without a loop over blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import GeometryError, GroupLayoutError
from ._regions import RegionPlan

__all__ = ["capacity_offsets", "local_descriptor_table", "remote_descriptor_table"]

_U64 = np.uint64


def capacity_offsets(capacities: Sequence[int] | np.ndarray) -> np.ndarray:
    """Exclusive prefix sum ``O`` of per-region capacities: region r starts at ``O[r]``."""
    c = np.asarray(capacities, dtype=np.int64)
    out = np.zeros(len(c), dtype=np.int64)
    if len(c) > 1:
        np.cumsum(c[:-1], out=out[1:])
    return out


def _per_region(name: str, value, n: int) -> np.ndarray:
    """A scalar or per-region sequence of non-negative ints as an (n,) uint64 array."""
    a = np.asarray(value)
    if a.ndim == 0:
        a = np.full(n, a)
    elif a.shape != (n,):
        raise GroupLayoutError(
            f"{name} has shape {a.shape}, expected one entry per region ({n})"
        )
    if a.size and a.dtype.kind not in "iuO":
        raise GeometryError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind in "iO" and min(int(x) for x in a.tolist()) < 0:
        raise GeometryError(f"{name} must be >= 0, got {min(int(x) for x in a.tolist())}")
    try:
        return a.astype(_U64) if a.dtype != object else np.array(a.tolist(), dtype=_U64)
    except OverflowError as exc:
        raise GeometryError(f"{name} does not fit in 64 bits") from exc


def _table(
    addrs: np.ndarray,
    strides: np.ndarray,
    sub_lens: np.ndarray,
    counts: np.ndarray,
    devices: np.ndarray,
    k: int,
) -> np.ndarray:
    """Rows ``addr_r + b*stride_r + s*sub_len_r`` for b < counts[r], s < k (all uint64)."""
    rows_per_region = counts.astype(np.int64) * k
    total = int(rows_per_region.sum())
    table = np.empty((total, 3), dtype=_U64)
    if total == 0:
        return table
    region = np.repeat(np.arange(len(counts)), rows_per_region)
    within = np.arange(total, dtype=np.int64) - capacity_offsets(rows_per_region)[region]
    if k == 1:
        table[:, 0] = addrs[region] + within.astype(_U64) * strides[region]
    else:
        b = (within // k).astype(_U64)
        s = (within % k).astype(_U64)
        table[:, 0] = addrs[region] + b * strides[region] + s * sub_lens[region]
    table[:, 1] = sub_lens[region]
    table[:, 2] = devices[region]
    return table


def local_descriptor_table(
    plan: RegionPlan,
    block_size_ratio: int = 1,
    *,
    split_reads: int = 1,
    split_index: int = 0,
) -> np.ndarray:
    """The local dlist rows of ``plan`` (spec §2.7 ``_build_fa_local``).

    Region-major; region r contributes ``num_blocks[r] * k`` rows
    ``addr = base + b*stride + s*(len/k)``, ``len = len/k``, ``dev`` = the region's device
    (0 for DRAM). With ``split_reads > 1`` (P_TP > D_TP, SPLIT regions), builds the list for
    source ``split_index``: each non-MLA row is narrowed to its ``1/split_reads`` head slice
    at ``split_index * len/k/split_reads``; MLA rows are left whole.

    Raises :class:`GeometryError` when ``k`` or ``split_reads`` does not divide a block.
    """
    k = _positive("block_size_ratio", block_size_ratio)
    splits = _positive("split_reads", split_reads)
    if not 0 <= split_index < splits:
        raise GeometryError(f"split_index must be in [0, {splits}), got {split_index}")
    lens = plan.block_lens
    bad = np.nonzero(lens % k)[0]
    if bad.size:
        r = int(bad[0])
        raise GeometryError(
            f"region {r} ({plan.names[r]!r}): block_len {int(lens[r])} is not divisible "
            f"by block_size_ratio {k}"
        )
    sub = lens // k
    addrs = plan.addrs.copy()
    if splits > 1:
        split = ~np.array(plan.is_mla, dtype=bool)
        bad = np.nonzero(split & (sub % splits != 0))[0]
        if bad.size:
            r = int(bad[0])
            raise GeometryError(
                f"region {r} ({plan.names[r]!r}): sub-block length {int(sub[r])} is not "
                f"divisible by split_reads {splits}"
            )
        sub = np.where(split, sub // splits, sub)
        addrs = addrs + np.where(split, sub * split_index, 0).astype(_U64)
    return _table(
        addrs,
        plan.block_strides.astype(_U64),
        sub.astype(_U64),
        plan.region_num_blocks,
        plan.device_ids.astype(_U64),
        k,
    )


def remote_descriptor_table(
    addrs: Sequence[int] | np.ndarray,
    block_strides: Sequence[int] | np.ndarray,
    region_num_blocks: Sequence[int] | np.ndarray,
    read_lens: int | Sequence[int] | np.ndarray,
    device_id: int | Sequence[int] | np.ndarray,
    rank_offsets: int | Sequence[int] | np.ndarray = 0,
) -> np.ndarray:
    """The remote dlist rows for one remote rank (spec §2.7 ``_build_fa_remote``).

    Region r contributes ``region_num_blocks[r]`` rows
    ``(base_r + rank_offset_r + b*stride_r, read_len_r, device)``. ``read_lens``,
    ``device_id`` and ``rank_offsets`` are scalars or per-region sequences.
    Raises :class:`GroupLayoutError` when per-region inputs disagree in length.
    """
    base = np.asarray(addrs)
    n = int(base.shape[0]) if base.ndim == 1 else -1
    if n < 0:
        raise GroupLayoutError(f"addrs must be a 1-D per-region sequence, got shape {base.shape}")
    base = _per_region("addrs", addrs, n)
    strides = _per_region("block_strides", block_strides, n)
    counts = _per_region("region_num_blocks", region_num_blocks, n)
    lens = _per_region("read_lens", read_lens, n)
    if n and (lens == 0).any():
        r = int(np.nonzero(lens == 0)[0][0])
        raise GeometryError(f"read_lens[{r}] must be > 0")
    devices = _per_region("device_id", device_id, n)
    offsets = _per_region("rank_offsets", rank_offsets, n)
    return _table(base + offsets, strides, lens, counts, devices, 1)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise GeometryError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)
