"""untransferred_ranges (spec §4.9, invariant §6.3.8) against a byte-set reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.geometry import (
    BlockIdRangeError,
    CacheView,
    GeometryError,
    compute_desc_ids,
    map_to_sub_blocks,
    plan_regions,
    untransferred_ranges,
)

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _plan(regions):
    """regions: (addr, num_blocks, block_len, block_stride, mem_type, device_id) tuples."""
    views = []
    for i, (addr, n, ln, st_, mem, dev) in enumerate(regions):
        views.append(CacheView.from_range(
            f"model.layers.{i}.attn", addr, max(n, 1) * st_, group_id=0, num_blocks=n,
            mem_type=mem, device_id=dev, block_len=ln, block_stride=st_))
    return plan_regions(views)


# -- plain-Python reference: bytes, not ranges --------------------------------------------


def ref_desc_bytes(regions, k):
    """Per descriptor id (region-major at ratio k): (mem_type, device, set of bytes)."""
    out = []
    for addr, n, ln, st_, mem, dev in regions:
        sub = ln // k
        dev = dev if mem == "VRAM" else 0
        for b in range(n):
            for s in range(k):
                start = addr + b * st_ + s * sub
                out.append((mem, dev, set(range(start, start + sub))))
    return out


def ref_zero_bytes(regions, k, allocated, transferred):
    descs = ref_desc_bytes(regions, k)
    want: dict[tuple[str, int], set[int]] = {}
    moved: set[tuple[str, int, int]] = set()
    for d in transferred:
        mem, dev, nbytes = descs[d]
        moved |= {(mem, dev, x) for x in nbytes}
    for d in allocated:
        mem, dev, nbytes = descs[d]
        keep = {x for x in nbytes if (mem, dev, x) not in moved}
        if keep:
            want.setdefault((mem, dev), set()).update(keep)
    return want


def got_bytes(out):
    got: dict[tuple[str, int], set[int]] = {}
    for mem, rows in out.items():
        assert rows.dtype == np.uint64 and rows.ndim == 2 and rows.shape[1] == 3
        assert rows.shape[0] > 0, "empty memory types are left out"
        for addr, n, dev in rows.tolist():
            assert n > 0
            got.setdefault((mem, dev), set()).update(range(addr, addr + n))
    return got


def assert_sorted_and_merged(out):
    for rows in out.values():
        keys = [(dev, addr) for addr, _n, dev in rows.tolist()]
        assert keys == sorted(keys)
        for (a0, n0, d0), (a1, _n1, d1) in zip(rows.tolist(), rows.tolist()[1:], strict=False):
            if d0 == d1:
                assert a0 + n0 < a1, "overlapping or adjacent ranges were not merged"


@st.composite
def layouts(draw):
    k = draw(st.integers(1, 3))
    n_regions = draw(st.integers(1, 4))
    regions = []
    addr = 4096
    for _ in range(n_regions):
        addr += draw(st.sampled_from([0, 0, 8, 1000]))    # 0: adjacent to the previous one
        n = draw(st.integers(0, 5))
        ln = k * draw(st.integers(1, 4))
        st_ = ln + draw(st.sampled_from([0, 0, 3, 16]))
        mem = draw(st.sampled_from(["DRAM", "VRAM"]))
        dev = draw(st.integers(0, 1)) if mem == "VRAM" else 0
        regions.append((addr, n, ln, st_, mem, dev))
        addr += max(n, 1) * st_
    total = sum(r[1] for r in regions) * k
    ids = st.integers(0, max(total - 1, 0))
    allocated = draw(st.lists(ids, max_size=3 * total)) if total else []
    transferred = draw(st.lists(st.sampled_from(allocated), max_size=len(allocated))
                       if allocated else st.just([]))
    if total and draw(st.booleans()):                      # ids the request does not own
        transferred += draw(st.lists(ids, max_size=3))
    return regions, k, allocated, transferred


@SETTINGS
@given(layouts())
def test_matches_byte_set_reference(case):
    regions, k, allocated, transferred = case
    plan = _plan(regions)
    assert [r.addr for r in plan.regions] == [r[0] for r in regions]   # natural name order
    out = untransferred_ranges(plan, np.array(allocated, dtype=np.int64),
                               np.array(transferred, dtype=np.int64), k)
    assert got_bytes(out) == ref_zero_bytes(regions, k, allocated, transferred)
    assert_sorted_and_merged(out)
    # Python lists in give the same answer.
    lists = untransferred_ranges(plan, allocated, transferred, k)
    assert lists.keys() == out.keys()
    for mem in out:
        np.testing.assert_array_equal(lists[mem], out[mem])


def test_tail_sub_blocks_of_the_last_partial_block():
    # 2 regions, 8 blocks of 256 B, k = 2: local blocks [2, 5] hold 4 sub-blocks, the
    # remote has 3 kernel blocks, so sub-block 11 (second half of block 5) is not read.
    regions = [(1 << 20, 8, 256, 256, "VRAM", 0), (2 << 20, 8, 256, 256, "VRAM", 0)]
    plan = _plan(regions)
    caps, gids = plan.region_num_blocks, plan.group_ids
    allocated = compute_desc_ids([map_to_sub_blocks([2, 5], 2)], caps, gids,
                                 block_size_ratio=2)
    read = compute_desc_ids([map_to_sub_blocks([2, 5], 2, 3)], caps, gids,
                            block_size_ratio=2)
    out = untransferred_ranges(plan, allocated, read, 2)
    assert list(out) == ["VRAM"]
    assert out["VRAM"].tolist() == [[(1 << 20) + 5 * 256 + 128, 128, 0],
                                    [(2 << 20) + 5 * 256 + 128, 128, 0]]


def test_clipped_whole_blocks_merge_and_split_by_memory_type():
    # DRAM region 0, VRAM region 1 on device 1; kernel blocks 3, 4 clipped in both.
    regions = [(1 << 20, 8, 64, 64, "DRAM", 0), (2 << 20, 8, 64, 96, "VRAM", 1)]
    plan = _plan(regions)
    caps, gids = plan.region_num_blocks, plan.group_ids
    allocated = compute_desc_ids([[1, 2, 3, 4]], caps, gids)
    read = compute_desc_ids([[1, 2]], caps, gids)
    out = untransferred_ranges(plan, allocated, read)
    assert out["DRAM"].tolist() == [[(1 << 20) + 3 * 64, 128, 0]]       # merged: contiguous
    assert out["VRAM"].tolist() == [[(2 << 20) + 3 * 96, 64, 1],        # stride gap kept out
                                    [(2 << 20) + 4 * 96, 64, 1]]


def test_nothing_to_zero():
    plan = _plan([(1 << 20, 4, 64, 64, "VRAM", 0)])
    assert untransferred_ranges(plan, [], []) == {}
    assert untransferred_ranges(plan, [0, 1], [1, 0]) == {}


def test_errors():
    plan = _plan([(1 << 20, 4, 64, 64, "VRAM", 0), (2 << 20, 4, 96, 96, "DRAM", 0)])
    with pytest.raises(BlockIdRangeError, match="allocated_ids: descriptor id 8"):
        untransferred_ranges(plan, [8], [])
    with pytest.raises(BlockIdRangeError, match="transferred_ids: descriptor id -1"):
        untransferred_ranges(plan, [0], [-1])
    with pytest.raises(GeometryError, match="block_size_ratio must be an int >= 1"):
        untransferred_ranges(plan, [0], [], 0)
    with pytest.raises(GeometryError, match="block_len 64 is not divisible by "
                                            "block_size_ratio 5"):
        untransferred_ranges(plan, [0], [], 5)
