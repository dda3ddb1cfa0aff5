"""The pull's cached route computes the very ids of the general planner (property test), and
leaves every request it cannot plan to that planner. Pure: no NIXL agent."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbridge_agent import geometry as geo
from kvbridge_agent.nixl import RemoteEngine, plan_read_ids
from kvbridge_agent.nixl._readplan import local_desc_layout, remote_desc_layout
from kvbridge_agent.nixl._route import ReadRoute, route_eligible

BLOCK_SIZE = 16


def _plan(group_ids: list[int], caps: list[int]) -> geo.RegionPlan:
    """Regions of alternating 64- and 128-byte blocks."""
    views = [geo.CacheView.from_range(
        f"model.layers.{i}.attn", (i + 1) * (1 << 24), c * 64 * (1 + i % 2), group_id=g,
        num_blocks=c, mem_type="VRAM", block_len=64 * (1 + i % 2))
        for i, (g, c) in enumerate(zip(group_ids, caps, strict=True))]
    return geo.plan_regions(views)


def _remote(group_ids: list[int], caps: list[int], ppl: int) -> RemoteEngine:
    r = len(caps)
    return RemoteEngine(
        engine_id="p", agent_metadata=b"", tp_rank=0, tp_size=1, num_blocks=max(caps),
        block_size=BLOCK_SIZE, ppl=ppl, device_id=0,
        base_addrs=tuple((i + 1) << 30 for i in range(r)), block_lens=(64,) * r,
        block_strides=(128,) * r, region_num_blocks=tuple(caps),
        region_group_ids=tuple(group_ids), region_mem_types=("VRAM",) * r)


def _route(plan: geo.RegionPlan, remote: RemoteEngine, local_ppl: int) -> ReadRoute:
    return ReadRoute(agent_name="p-agent", local_list=None, remote_list=None,  # type: ignore[arg-type]
                     local_layout=local_desc_layout(plan, 1, False),
                     remote_layout=remote_desc_layout(remote, False), local_ppl=local_ppl,
                     remote_ppl=remote.ppl, local_consumers=1, label="VRAM<-VRAM@p-agent",
                     block_lens=plan.block_lens)


def _planner(plan, remote, local_ppl, lids, rids):
    return plan_read_ids(plan, local_block_size=BLOCK_SIZE, local_ppl=local_ppl, remote=remote,
                         local_block_ids=lids, remote_block_ids=rids)


@st.composite
def _requests(draw):
    groups = draw(st.integers(1, 3))
    group_ids = draw(st.lists(st.integers(0, groups - 1), min_size=1, max_size=6))
    caps = draw(st.lists(st.integers(4, 24), min_size=len(group_ids),
                         max_size=len(group_ids)))
    ppl = draw(st.sampled_from([1, 1, 2]))
    local_ppl = draw(st.sampled_from([1, ppl]))
    limit = min(caps) // max(ppl, local_ppl) + 2       # + 2: some ids out of range
    ids = st.integers(-1, limit)                       # -1: negative ids are refused too
    lids, rids = [], []
    for _ in range(groups):
        n_remote = draw(st.integers(0, 5))
        n_local = draw(st.integers(0, n_remote + 1))      # + 1: sometimes longer than P's
        rids.append(draw(st.lists(ids, min_size=n_remote, max_size=n_remote)))
        lids.append(draw(st.lists(ids, min_size=n_local, max_size=n_local)))
    if draw(st.booleans()):      # vLLM hands lists; other callers numpy arrays
        lids = [np.array(g, dtype=np.int64) for g in lids]
        rids = [np.array(g, dtype=np.int64) for g in rids]
    return group_ids, caps, ppl, local_ppl, lids, rids


@settings(max_examples=400, deadline=None)
@given(_requests())
def test_route_ids_equal_the_planners_or_defer_to_it(case):
    group_ids, caps, ppl, local_ppl, lids, rids = case
    plan, remote = _plan(group_ids, caps), _remote(group_ids, caps, ppl)
    route = _route(plan, remote, local_ppl)
    try:
        want = _planner(plan, remote, local_ppl, lids, rids)
    except geo.GeometryError as planner_error:
        # the route raises the same kind of error, or leaves the request to the planner
        try:
            got = route.read_ids(lids, rids)
        except geo.GeometryError as route_error:
            assert type(route_error) is type(planner_error)
        else:
            assert got is None
        return
    got = route.read_ids(lids, rids)
    event("deferred" if got is None else "routed")
    if got is None:     # deferred: only when some group of D is longer than P's
        assert any(len(d) * local_ppl > len(p) * ppl for d, p in zip(lids, rids, strict=True))
        return
    assert want.allocated_ids is None and want.k == 1 and not want.region_mapped
    np.testing.assert_array_equal(got[0], want.local_ids)
    np.testing.assert_array_equal(got[1], want.remote_ids)
    layout = route.local_layout            # bytes: each descriptor's region's block length
    region = np.searchsorted(layout.offsets, want.local_ids, side="right") - 1
    assert got[2] == int(plan.block_lens[region].sum())


def test_route_defers_what_it_does_not_plan():
    plan, remote = _plan([0, 1], [8, 8]), _remote([0, 1], [8, 8], 1)
    route = _route(plan, remote, 1)
    assert route.read_ids([[1, 2]], [[3, 4], [5]]) is None          # group counts differ
    assert route.read_ids([[1.0]], [[2.0]]) is None                 # not integers
    assert route.read_ids([[1, 2, 3], []], [[4, 5], []]) is None     # D longer than P
    one = _route(_plan([0, 0], [8, 8]), _remote([0, 0], [8, 8], 1), 1)   # the one-group path
    for lids, rids in [([1.0], [2]), ([True], [1]), (["1"], [2]), ([1], [[2]]), ([1, 2], [3])]:
        for kind in (list, np.array):                                  # not ids, D longer
            assert one.read_ids([kind(lids)], [kind(rids)]) is None, (lids, rids, kind)
    for lids, rids in [([-1], [2]), ([8], [2]), ([1], [8]), ([1], [-1])]:
        for kind in (list, np.array):                                  # out of range
            with pytest.raises(geo.BlockIdRangeError):
                one.read_ids([kind(lids)], [kind(rids)])
    lids, rids, nbytes = one.read_ids([[1, 2]], [[0, 3, 4]])          # the last of P's pages
    assert lids.tolist() == [1, 2, 9, 10] and rids.tolist() == [3, 4, 11, 12]
    assert lids.dtype == rids.dtype == np.int32 and nbytes == 2 * (64 + 128)
    lids, rids, nbytes = route.read_ids([[1, 2], [3]], [[4, 5, 6], [7]])
    assert lids.tolist() == [1, 2, 11] and rids.tolist() == [5, 6, 15]
    assert nbytes == 2 * 64 + 128


@pytest.mark.parametrize(("change", "eligible"), [
    ({}, True),
    ({"remote_group_ids": [0, 0]}, False),      # different groups: region-mapped path
    ({"remote_block_size": 32}, False),         # block-size ratio
    ({"local_kinds": ["VRAM", "DRAM"]}, False),  # mixed memory: split into parts
    ({"source_ranks": 2}, False),               # TP: several sources
    ({"notify_ranks": 1}, False),               # MLA replicas to notify
    ({"split_reads": 2}, False),
    ({"remote_group_ids": []}, False),          # a remote without regions
])
def test_route_eligibility(change, eligible):
    args = {"local_group_ids": [0, 1], "remote_group_ids": [0, 1], "local_block_size": 16,
            "remote_block_size": 16, "local_kinds": ["VRAM"], "remote_kinds": ["DRAM"],
            "source_ranks": 1, "notify_ranks": 0, "split_reads": 1, **change}
    assert route_eligible(**args) is eligible
