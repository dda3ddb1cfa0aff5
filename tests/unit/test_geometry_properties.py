"""Property-based tests: the geometry core against plain-Python references (the spec §6.3
byte-range invariants live in test_geometry_invariants.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.geometry import (
    BlockIdRangeError,
    CacheView,
    DescIdLayout,
    GeometryError,
    GroupLayoutError,
    RegionAliasError,
    align_prefix_by_region,
    block_ids_by_region,
    compute_desc_ids,
    local_descriptor_table,
    mem_type_index,
    partition_by_mem_type,
    plan_regions,
    remote_descriptor_table,
    split_table_by_mem_type,
)

SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# -- plain-Python reference (spec §3, §4.3, §4.4, §2.7, §4.6) ------------------------------


def ref_desc_ids(block_ids, caps, gids, uses=None, k=None):
    c = [x * k for x in caps] if k else list(caps)
    o = [sum(c[:r]) for r in range(len(c))]
    if uses is None:
        uses = len(set(gids)) > 1
    if not uses:
        flat = [b for entry in block_ids for b in entry]
        return [o[r] + b for r in range(len(c)) for b in flat]
    out = []
    for g, entry in enumerate(block_ids):
        if not entry:
            continue
        targets = [r for r in range(len(c)) if gids[r] in (g, -1)]
        assert targets, "group without region"
        out += [o[r] + b for r in targets for b in entry]
    return out


def ref_by_region(block_ids, gids):
    return [
        [b for entry in block_ids for b in entry] if g == -1 else list(block_ids[g])
        for g in gids
    ]


def ref_local_table(bases, lens, strides, caps, k):
    return [
        (bases[r] + b * strides[r] + s * (lens[r] // k), lens[r] // k)
        for r in range(len(bases))
        for b in range(caps[r])
        for s in range(k)
    ]


def ref_partition(local_ids, remote_ids, local_types, remote_types):
    def positions(types):
        seen: dict[str, int] = {}
        pos = []
        for t in types:
            pos.append(seen.get(t, 0))
            seen[t] = pos[-1] + 1
        return pos

    lpos, rpos = positions(local_types), positions(remote_types)
    parts: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    for li, ri in zip(local_ids, remote_ids, strict=True):
        key = (local_types[li], remote_types[ri])
        parts.setdefault(key, ([], []))
        parts[key][0].append(lpos[li])
        parts[key][1].append(rpos[ri])
    return [(k[0], k[1], v[0], v[1]) for k, v in sorted(parts.items())]


# -- compute_desc_ids vs reference ----------------------------------------------------------


@st.composite
def desc_id_cases(draw):
    r = draw(st.integers(1, 10))
    g = draw(st.integers(1, 7))  # > 4 live groups takes the all-groups-at-once path
    caps = draw(st.lists(st.integers(0, 25), min_size=r, max_size=r))
    gids = draw(st.lists(st.integers(-1, g - 1), min_size=r, max_size=r))
    k = draw(st.sampled_from([None, 1, 2, 4]))
    uses = draw(st.sampled_from([None, None, True, False]))
    eff = [c * (k or 1) for c in caps]
    mapping = len(set(gids)) > 1 if uses is None else uses
    block_ids = []
    for gi in range(g):
        targets = [eff[x] for x in range(r) if gids[x] in (gi, -1)] if mapping else eff
        limit = min(targets) if targets else 0
        if limit == 0:
            block_ids.append([])
        else:
            block_ids.append(draw(st.lists(st.integers(0, limit - 1), max_size=6)))
    if not mapping:
        # the fast path sends every id to every region: keep ids below the smallest capacity
        low = min(eff)
        block_ids = [[b for b in e if b < low] for e in block_ids]
    return block_ids, caps, gids, k, uses


@SETTINGS
@given(desc_id_cases())
def test_desc_ids_match_reference(case) -> None:
    block_ids, caps, gids, k, uses = case
    got = compute_desc_ids(block_ids, caps, gids, uses_group_mapping=uses, block_size_ratio=k)
    assert got.dtype == np.int64
    assert got.tolist() == ref_desc_ids(block_ids, caps, gids, uses, k)
    # a layout built once serves many requests, identical to the one-shot call
    layout = DescIdLayout(caps, gids, uses_group_mapping=uses, block_size_ratio=k)
    for ids in (block_ids, [e[::-1] for e in block_ids], block_ids):
        assert layout.desc_ids(ids).tolist() == ref_desc_ids(ids, caps, gids, uses, k)


@SETTINGS
@given(desc_id_cases(), st.integers(0, 40))
def test_out_of_range_ids_are_rejected_exactly_when_reference_leaves_a_region(case, bad):
    block_ids, caps, gids, k, uses = case
    block_ids = [*block_ids[:-1], [*block_ids[-1], bad]]
    eff = [c * (k or 1) for c in caps]
    mapping = len(set(gids)) > 1 if uses is None else uses
    last = len(block_ids) - 1
    targets = [
        x for x in range(len(caps)) if not mapping or gids[x] in (last, -1)
    ]
    if not targets:
        with pytest.raises(GroupLayoutError):
            compute_desc_ids(block_ids, caps, gids, uses_group_mapping=uses,
                             block_size_ratio=k)
        return
    if any(bad >= eff[x] for x in targets):
        with pytest.raises(BlockIdRangeError):
            compute_desc_ids(block_ids, caps, gids, uses_group_mapping=uses,
                             block_size_ratio=k)
    else:
        got = compute_desc_ids(block_ids, caps, gids, uses_group_mapping=uses,
                               block_size_ratio=k)
        assert got.tolist() == ref_desc_ids(block_ids, caps, gids, uses, k)


@SETTINGS
@given(
    st.lists(st.lists(st.integers(0, 50), max_size=5), min_size=1, max_size=4).flatmap(
        lambda ids: st.tuples(
            st.just(ids),
            st.lists(st.integers(-1, len(ids) - 1), min_size=1, max_size=6),
        )
    )
)
def test_block_ids_by_region_matches_reference(case) -> None:
    ids, gids = case
    got = block_ids_by_region(ids, gids)
    assert [x.tolist() for x in got] == ref_by_region(ids, gids)


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 8)),
        min_size=1, max_size=5,
    ),
    st.integers(0, 10),
    st.booleans(),
)
def test_align_prefix_by_region_matches_reference(rows, n_remote, positional) -> None:
    decode = [list(range(100, 100 + nd)) for nd, _, _ in rows]
    prefill = [list(range(np_)) for _, np_, _ in rows]
    starts = [s for _, _, s in rows]
    if not any(decode):
        exp_l, exp_r = [[] for _ in rows], [[] for _ in rows]
    elif positional:
        exp_l, exp_r, err = [], [], False
        for d, p, s in zip(decode, prefill, starts, strict=True):
            count = min(len(d), max(n_remote - s, 0))
            err = err or (count > 0 and len(p) < s + count)
            exp_l.append(d[:count])
            exp_r.append(p[s : s + count])
        if err:
            with pytest.raises(ValueError, match="do not cover"):
                align_prefix_by_region(decode, prefill, num_computed_blocks=starts,
                                       num_remote_blocks=n_remote)
            return
    else:
        if any(len(d) > len(p) for d, p in zip(decode, prefill, strict=True)):
            with pytest.raises(ValueError, match="decode allocated more"):
                align_prefix_by_region(decode, prefill)
            return
        exp_l = decode
        exp_r = [p[len(p) - len(d) :] if d else [] for d, p in zip(decode, prefill, strict=True)]
    kw = {"num_computed_blocks": starts, "num_remote_blocks": n_remote} if positional else {}
    got_l, got_r = align_prefix_by_region(decode, prefill, **kw)
    assert [x.tolist() for x in got_l] == exp_l
    assert [x.tolist() for x in got_r] == exp_r


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["VRAM", "DRAM"]),
                       st.integers(1, 4)), min_size=1, max_size=5),
    st.sampled_from([1, 2]),
    st.data(),
)
def test_tables_and_partition_match_reference(regions, k, data) -> None:
    caps = [c for c, _, _ in regions]
    ltypes = [t for _, t, _ in regions]
    lens = [16 * m * k for _, _, m in regions]
    strides = [ln * 2 for ln in lens]
    bases = [10_000 * (i + 1) for i in range(len(regions))]
    table = remote_descriptor_table(bases, strides, caps, [ln // k for ln in lens], 0)
    ref = ref_local_table(bases, lens, strides, caps, 1)
    assert [(int(a), int(b) * k) for a, b, _ in table.tolist()] == ref
    plan = plan_regions(
        CacheView(f"l.{i}", 0, bases[i], caps[i], lens[i], strides[i], ltypes[i])
        for i in range(len(regions))
    )
    ltab = local_descriptor_table(plan, k)
    assert [(int(a), int(b)) for a, b, _ in ltab.tolist()] == ref_local_table(
        bases, lens, strides, caps, k
    )
    lidx = mem_type_index(ltypes, caps, k)
    n = len(ltab)
    assert len(lidx) == n == sum(caps) * k  # §6.3 (3)
    rtypes = data.draw(st.lists(st.sampled_from(["VRAM", "DRAM"]), min_size=1, max_size=3))
    rcaps = data.draw(st.lists(st.integers(1, 5), min_size=len(rtypes), max_size=len(rtypes)))
    ridx = mem_type_index(rtypes, rcaps)
    if n == 0:
        return
    m = data.draw(st.integers(0, 12))
    lids = data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))
    rids = data.draw(st.lists(st.integers(0, sum(rcaps) - 1), min_size=m, max_size=m))
    flat_l = [t for c, t in zip(caps, ltypes, strict=True) for _ in range(c * k)]
    flat_r = [t for c, t in zip(rcaps, rtypes, strict=True) for _ in range(c)]
    got = partition_by_mem_type(lids, rids, lidx, ridx)
    assert [
        (p.local_mem_type, p.remote_mem_type, p.local_ids.tolist(), p.remote_ids.tolist())
        for p in got
    ] == ref_partition(lids, rids, flat_l, flat_r)
    # resolved through the per-type tables, every part addresses the original rows
    split = split_table_by_mem_type(ltab, lidx)
    rows = [tuple(r) for p in got for r in split[p.local_mem_type][p.local_ids].tolist()]
    assert sorted(rows) == sorted(tuple(r) for r in ltab[lids].tolist())


# -- region dedup / overlap detection vs brute force ----------------------------------------


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 160), st.integers(1, 12), st.integers(1, 3),
                  st.integers(0, 5), st.integers(0, 1)),
        min_size=1, max_size=4,
    )
)
def test_plan_overlap_detection_matches_brute_force(specs) -> None:
    views = [
        CacheView(f"l.{i}", g, addr, n, length, length * mult)
        for i, (addr, length, mult, n, g) in enumerate(specs)
    ]
    # reference fold: same (addr, len) -> one region; stride must agree; last MLA view's
    # capacity wins; groups differ -> shared
    folded: dict[tuple[int, int], list] = {}
    stride_conflict = False
    for v in views:
        cur = folded.get((v.addr, v.block_len))
        if cur is None:
            folded[(v.addr, v.block_len)] = [v.block_stride, v.num_blocks, v.group_id]
            continue
        stride_conflict |= cur[0] != v.block_stride
        cur[1] = v.num_blocks
        cur[2] = cur[2] if cur[2] == v.group_id else -1

    def spans(addr, length, stride, n):
        return [(addr + b * stride, addr + b * stride + length) for b in range(n)]

    regions = [(a, ln, s, n) for (a, ln), (s, n, _) in folded.items()]
    overlap = any(
        x0 < y1 and y0 < x1
        for i, ra in enumerate(regions)
        for rb in regions[i + 1 :]
        for x0, x1 in spans(*ra)
        for y0, y1 in spans(*rb)
    )
    if stride_conflict or overlap:
        with pytest.raises(RegionAliasError):
            plan_regions(views)
        return
    plan = plan_regions(views)
    got = sorted((r.addr, r.block_len, r.block_stride, r.num_blocks, r.group_id)
                 for r in plan.regions)
    assert got == sorted((a, ln, s, n, g) for (a, ln), (s, n, g) in folded.items())
    assert list(plan.names) == sorted(plan.names, key=lambda x: int(x.split(".")[1]))


# -- any input: the reference ids or a GeometryError naming the problem, nothing else -------


def _as_input(draw, values, dtype_choices):
    if min(values, default=0) < 0:
        dtype_choices = [c for c in dtype_choices if not c.startswith("uint")]
    how = draw(st.sampled_from(dtype_choices))
    if how == "list":
        return list(values)
    if how == "tuple":
        return tuple(values)
    if how == "strided":
        a = np.repeat(np.asarray(values, dtype=np.int64), 2)
        return a[::2]
    return np.asarray(values, dtype=how)


@st.composite
def any_desc_id_inputs(draw):
    """Mostly valid inputs of every accepted type, sometimes subtly invalid ones."""
    r = draw(st.integers(0, 8))
    g = draw(st.integers(0, 9))
    odd = draw(st.integers(0, 3)) == 0        # a quarter of the cases may be invalid
    caps = draw(st.lists(st.integers(-1 if odd else 0, 12), min_size=r, max_size=r))
    n_gids = draw(st.sampled_from([r, r, r, r + 1])) if odd else r
    gids = draw(st.lists(st.integers(-2 if odd else -1, max(g - 1, 0) + (2 if odd else 0)),
                         min_size=n_gids, max_size=n_gids))
    if draw(st.booleans()):
        gids = list(range(r))                                   # region-mapped layout
    kinds = ["list", "tuple", "strided", "int64", "int32", "uint16"]
    caps_in = _as_input(draw, caps, [*kinds, "float64"] if odd else kinds)
    gids_in = _as_input(draw, gids, kinds)
    k = draw(st.sampled_from([None, None, 1, 2, 3, 0, True, np.int64(2)] if odd
                             else [None, None, 1, 2, 3]))
    top = max(min(caps, default=0) * (k if isinstance(k, int) and k > 1 else 1), 1)
    entries = []
    for _ in range(g):
        ids = draw(st.lists(st.integers(-2 if odd else 0, top + (2 if odd else -1)),
                            max_size=5))
        if odd and draw(st.integers(0, 5)) == 0:
            entries.append(draw(st.sampled_from([[True, False], [1.5], [[1, 2]], np.array([]),
                                                 np.array([[1]]), ["1"]])))
        else:
            choices = ["list", "tuple", "strided", "int64", "int32", "uint8"]
            entries.append(_as_input(draw, ids, choices))
    block_ids = tuple(entries) if draw(st.booleans()) else entries
    uses = draw(st.sampled_from([None, None, True, False]))
    return block_ids, caps_in, gids_in, k, uses


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_desc_id_inputs())
def test_any_input_gives_reference_ids_or_a_geometry_error(case) -> None:
    block_ids, caps, gids, k, uses = case
    try:
        got = compute_desc_ids(block_ids, caps, gids, uses_group_mapping=uses,
                               block_size_ratio=k)
    except GeometryError as exc:
        assert str(exc)
        return
    plain = [[int(b) for b in np.asarray(e).ravel()] for e in block_ids]
    ratio = int(k) if k is not None else None
    assert got.dtype == np.int64
    assert got.tolist() == ref_desc_ids(plain, [int(c) for c in np.asarray(caps)],
                                         [int(x) for x in np.asarray(gids)], uses, ratio)


@settings(max_examples=200, deadline=None)
@given(st.integers(5, 12), st.integers(1, 6), st.booleans(), st.data())
def test_region_mapped_layout_matches_reference(regions, length, equal, data) -> None:
    """More than four lists, one region each: the in-place broadcast (equal lengths) and
    the repeat (unequal) both give the reference ids and leave the inputs alone."""
    caps = [data.draw(st.integers(length, 30)) for _ in range(regions)]
    sizes = [length] * regions if equal else [data.draw(st.integers(1, length))
                                              for _ in range(regions)]
    lists = [data.draw(st.lists(st.integers(0, caps[r] - 1), min_size=n, max_size=n))
             for r, n in enumerate(sizes)]
    arrays = [np.array(x, dtype=np.int64) for x in lists]
    layout = DescIdLayout(caps, list(range(regions)), uses_group_mapping=True)
    want = ref_desc_ids(lists, caps, list(range(regions)), True, None)
    assert layout.desc_ids(arrays).tolist() == want
    assert layout.desc_ids(arrays).tolist() == want
    assert [a.tolist() for a in arrays] == lists


def test_compute_desc_ids_does_not_modify_inputs() -> None:
    caps = np.array([10, 10, 10], dtype=np.int64)
    gids = np.array([0, 1, 2], dtype=np.int64)
    ids = [np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int64),
           np.array([5, 6], dtype=np.int64)]
    for uses in (None, True):
        got = compute_desc_ids(ids, caps, gids, uses_group_mapping=uses)
        assert got.tolist() == [1, 2, 13, 14, 25, 26]
    assert [e.tolist() for e in ids] == [[1, 2], [3, 4], [5, 6]]
    assert caps.flags.writeable and gids.flags.writeable
    # more than four groups, one region each (the region-mapped shape): equal and unequal
    caps = np.full(6, 9, dtype=np.int64)
    gids = np.arange(6)
    for lists in ([[g, g + 1] for g in range(6)], [[g] * (g % 3) for g in range(6)]):
        arrays = [np.array(x, dtype=np.int64) for x in lists]
        want = [9 * r + b for r, x in enumerate(lists) for b in x]
        assert compute_desc_ids(arrays, caps, gids).tolist() == want
        assert [a.tolist() for a in arrays] == lists
