"""Property-based tests: the geometry core against a plain-Python reference, and the spec
§6.3 invariants checked on resolved byte ranges over random geometries and requests."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.geometry import (
    BlockIdRangeError,
    CacheView,
    DescIdLayout,
    GroupLayoutError,
    RegionAliasError,
    align_prefix_by_group,
    align_prefix_by_region,
    block_ids_by_region,
    compute_desc_ids,
    local_descriptor_table,
    map_to_sub_blocks,
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


# -- end-to-end §6.3 invariants on byte ranges ----------------------------------------------


@dataclass
class Side:
    plan: object
    caps: list[int]
    gids: list[int]
    lists: list[list[int]]  # per-group block ids of the request
    tokens_before: list[int]  # per group: units already present before lists[g][0]
    units_per_block: int


def _make_plan(names, caps, gids, lens, strides, types, base0):
    views = [
        CacheView(names[i], max(gids[i], 0), base0 + i * 1_000_000, caps[i], lens[i],
                  strides[i], types[i])
        for i in range(len(names))
    ]
    # shared (-1) regions: a second view per other group aliases the same region
    for i, g in enumerate(gids):
        if g == -1:
            views.append(CacheView(names[i] + ".alias", 1, base0 + i * 1_000_000, caps[i],
                                   lens[i], strides[i], types[i]))
    views.reverse()  # plan_regions must restore natural order
    return plan_regions(views)


@st.composite
def transfers(draw):
    r = draw(st.integers(1, 5))
    region_mapped = draw(st.booleans())
    k = 1 if region_mapped else draw(st.sampled_from([1, 1, 2, 3]))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(r)]
    if region_mapped:
        g_d = draw(st.integers(1, 3))
        g_p = draw(st.integers(1, 3))
        d_gids = draw(st.lists(st.integers(0, g_d - 1), min_size=r, max_size=r))
        p_gids = draw(st.lists(st.integers(0, g_p - 1), min_size=r, max_size=r))
        if d_gids == p_gids:
            p_gids = [0] * r
            d_gids = [(x + 1) % 2 for x in d_gids] if r > 1 or d_gids != [0] else [1]
        # groups with no region are not part of the request
        g_d, g_p = max(d_gids) + 1, max(p_gids) + 1
        tokens = draw(st.integers(1, 12))
        p_units = [tokens] * g_p
        d_units = [tokens] * g_d
    else:
        g = draw(st.integers(1, 3))
        gids = draw(st.lists(st.integers(-1, g - 1), min_size=r, max_size=r))
        used = sorted({x for x in gids if x >= 0}) or [0]
        remap = {old: new for new, old in enumerate(used)}
        gids = [remap.get(x, -1) for x in gids]
        g = len(used)
        d_gids = p_gids = gids
        g_d = g_p = g
        p_units = draw(st.lists(st.integers(1, 12), min_size=g, max_size=g))
        d_units = p_units
    positional = region_mapped and draw(st.booleans())
    # D: prefix hit per group in D blocks, request lists cover the rest (+ padding pages
    # for the positional rule); P: every unit of the prompt, one kernel block per unit.
    hits, d_counts = [], []
    for u in d_units:
        total = -(-u // k)
        h = draw(st.integers(0, total))
        pad = draw(st.integers(0, 2)) if positional and h < total else 0
        hits.append(h)
        d_counts.append(total - h + pad)
    mixed = draw(st.booleans())
    d_types = [draw(st.sampled_from(["VRAM", "DRAM"])) if mixed else "VRAM" for _ in names]
    p_types = ["VRAM"] * r if not mixed else [draw(st.sampled_from(["VRAM", "DRAM"]))
                                              for _ in names]
    d_need, p_need = sum(d_counts), sum(p_units)
    d_caps = [d_need + draw(st.integers(0, 4)) for _ in names]
    p_caps = [p_need + draw(st.integers(0, 4)) for _ in names]
    p_lens = [16 * draw(st.integers(1, 3)) for _ in names]
    d_lens = [ln * k for ln in p_lens]
    d_strides = [ln * draw(st.integers(1, 2)) for ln in d_lens]
    p_strides = [ln * draw(st.integers(1, 2)) for ln in p_lens]
    d_pool = draw(st.permutations(range(min(d_caps))))
    p_pool = draw(st.permutations(range(min(p_caps))))
    d_lists, p_lists, pos = [], [], 0
    for c in d_counts:
        d_lists.append(list(d_pool[pos : pos + c]))
        pos += c
    pos = 0
    for u in p_units:
        p_lists.append(list(p_pool[pos : pos + u]))
        pos += u
    d = Side(_make_plan(names, d_caps, d_gids, d_lens, d_strides, d_types, 1 << 32),
             d_caps, d_gids, d_lists, [h * k for h in hits], k)
    p = Side(_make_plan(names, p_caps, p_gids, p_lens, p_strides, p_types, 1 << 40),
             p_caps, p_gids, p_lists, [0] * g_p, 1)
    return d, p, k, region_mapped, positional, p_units


def _block_owner(side: Side, region: int) -> dict[int, tuple[int, int]]:
    """block id -> (group, position) for the request's blocks present in ``region``."""
    g = side.gids[region]
    groups = range(len(side.lists)) if g == -1 else [g]
    return {b: (gi, i) for gi in groups for i, b in enumerate(side.lists[gi])}


def _resolve(plan, row, k):
    """A descriptor's (addr, len) -> (region, block, sub-block), by address arithmetic."""
    addr, length = int(row[0]), int(row[1])
    bases = [int(a) for a in plan.addrs]
    r = bisect.bisect_right(bases, addr) - 1
    reg = plan.regions[r]
    off = addr - reg.addr
    b, within = divmod(off, reg.block_stride)
    sub_len = reg.block_len // k
    s, rest = divmod(within, sub_len)
    assert rest == 0 and length <= sub_len and b < reg.num_blocks and s < k
    return r, b, s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers())
def test_transfer_invariants_on_byte_ranges(case) -> None:
    d, p, k, region_mapped, positional, p_units = case
    assert d.plan.names == p.plan.names  # §6.3 (5)
    r = len(d.plan)
    if region_mapped:
        d_by = block_ids_by_region(d.lists, d.gids)
        p_by = block_ids_by_region(p.lists, p.gids)
        kw = {}
        if positional:
            kw = {
                "num_computed_blocks": [d.tokens_before[d.gids[x]] for x in range(r)],
                "num_remote_blocks": p_units[0],
            }
        local, remote = align_prefix_by_region(d_by, p_by, **kw)
        ident = list(range(r))
        local_ids = compute_desc_ids(local, d.caps, ident, uses_group_mapping=r > 1)
        remote_ids = compute_desc_ids(remote, p.caps, ident, uses_group_mapping=r > 1)
    else:
        mapped = [
            map_to_sub_blocks(ids, k, remote_count=max(min(len(ids) * k, u - before), 0))
            for ids, u, before in zip(d.lists, p_units, d.tokens_before, strict=True)
        ]
        local, remote = align_prefix_by_group(mapped, p.lists)
        local_ids = compute_desc_ids(local, d.caps, d.gids,
                                     block_size_ratio=k if k > 1 else None)
        remote_ids = compute_desc_ids(remote, p.caps, p.gids)

    assert len(local_ids) == len(remote_ids)  # §6.3 (2)
    ltab = local_descriptor_table(d.plan, k)
    assert len(ltab) == sum(d.caps) * k  # §6.3 (3)
    rtab = remote_descriptor_table(p.plan.addrs, p.plan.block_strides, p.plan.region_num_blocks,
                                   d.plan.block_lens // k, 0)
    assert len(rtab) == sum(p.caps)
    l_owner = [_block_owner(d, x) for x in range(r)]
    r_owner = [_block_owner(p, x) for x in range(r)]
    covered = set()
    for li, ri in zip(local_ids.tolist(), remote_ids.tolist(), strict=True):
        lr, lb, ls = _resolve(d.plan, ltab[li], k)
        rr, rb, _rs = _resolve(p.plan, rtab[ri], 1)
        # §6.3 (1): both descriptors lie inside the request's own blocks
        assert lb in l_owner[lr], f"local descriptor outside the request: region {lr} b {lb}"
        assert rb in r_owner[rr], f"remote descriptor outside the request: region {rr} b {rb}"
        # §6.3 (2): same region, same token offset
        lg, lpos = l_owner[lr][lb]
        rg, rpos = r_owner[rr][rb]
        assert lr == rr
        l_token = d.tokens_before[lg] + lpos * k + ls
        r_token = rpos
        assert l_token == r_token, (lr, lg, lpos, ls, rg, rpos)
        if not region_mapped:
            assert lg == rg
        covered.add((lr, lg, l_token))
        # the local write fits in the bytes the remote read delivers
        assert int(ltab[li][1]) == int(rtab[ri][1])
    # every token D lacks (below the prompt length) is transferred exactly once per region
    expected = set()
    for x in range(r):
        for g in ({*range(len(d.lists))} if d.gids[x] == -1 else {d.gids[x]}):
            units = p_units[0] if region_mapped else p_units[g]
            expected |= {(x, g, t) for t in range(d.tokens_before[g], units)}
    assert covered == expected
    assert len(covered) == len(local_ids)

    # mixed memory: the per-type parts address exactly the same byte pairs
    lidx = mem_type_index(d.plan.mem_types, d.caps, k)
    ridx = mem_type_index(p.plan.mem_types, p.caps)
    parts = partition_by_mem_type(local_ids, remote_ids, lidx, ridx)
    assert sum(len(x) for x in parts) == len(local_ids)
    assert len(parts) <= len(lidx.mem_types) * len(ridx.mem_types)
    lsplit = split_table_by_mem_type(ltab, lidx)
    rsplit = split_table_by_mem_type(rtab, ridx)
    pairs = sorted(
        (tuple(a), tuple(b))
        for x in parts
        for a, b in zip(lsplit[x.local_mem_type][x.local_ids].tolist(),
                        rsplit[x.remote_mem_type][x.remote_ids].tolist(), strict=True)
    )
    assert pairs == sorted(
        (tuple(a), tuple(b)) for a, b in zip(ltab[local_ids].tolist(),
                                             rtab[remote_ids].tolist(), strict=True)
    )


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
