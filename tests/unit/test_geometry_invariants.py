"""Spec §6.3 invariants on resolved byte ranges, over random geometries and requests.

Each example builds a D and a P region plan, runs a request through the same steps the
data path takes (per-group end-trim or per-region alignment, sub-block mapping, descriptor
ids, descriptor tables, memory-type partition) and resolves every descriptor back to a
(region, block, sub-block) by address arithmetic.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.geometry import (
    CacheView,
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
