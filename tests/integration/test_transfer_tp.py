"""Heterogeneous TP pulls (spec §1.9): MLA replicas, head slices, split reads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _peers import EngineSpec, LocalSide, Memory, Peer, RegionSpec, expected_after

from kvbridge_agent.nixl import PullEngine, PullRequest, TransferDone

pytestmark = pytest.mark.nixl

_n = itertools.count()
NAMES = [f"model.layers.{i}.attn" for i in range(3)]


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _regions(block_len, *, mla):
    return tuple(RegionSpec(n, num_blocks=8, block_len=block_len, is_mla=mla) for n in NAMES)


def _mirror(spec):
    m = Memory(spec)
    m.fill_pattern(spec.seed)
    return m


def _assert(d, want):
    for name, buf in d.memory.buffers.items():
        np.testing.assert_array_equal(buf, want[name], err_msg=name)


def test_mla_reads_one_replica_and_notifies_every_covered_rank(peer):
    eid = f"tp-mla-{next(_n)}"
    p_specs = [EngineSpec(eid, _regions(128, mla=True), tp_rank=r, tp_size=2, seed=50 + r)
               for r in range(2)]
    d = LocalSide(EngineSpec(f"d-{eid}", _regions(128, mla=True)))
    engine = PullEngine(d.local, timeout_s=10)
    try:
        for s in p_specs:
            engine.add_remote(peer.call("create", s))
            peer.call("add_peer", s.key, d.describe())
            peer.call("register", s.key, ["mla-1"])
        before = d.memory.snapshot()
        engine.start(PullRequest("mla-1", eid, [[2, 3]], [[6, 7]]))
        res = engine.wait("mla-1")
        assert isinstance(res, TransferDone) and res.parts == 1, res
        assert sorted(res.notified) == sorted(s.name for s in p_specs)
        _assert(d, expected_after(d.memory, before, _mirror(p_specs[0]), {
            n: [(2 * 128, 6 * 128, 128), (3 * 128, 7 * 128, 128)] for n in NAMES}))
        for s in p_specs:   # each P rank frees with one "req:1"
            state = peer.wait_notifs(s.key, lambda st: "mla-1" in st["finished"])
            assert [m for _, m in state["log"]] == ["mla-1:1"]
    finally:
        engine.close()
        d.close()
        for s in p_specs:
            peer.call("close", s.key)


def test_more_decode_ranks_read_head_slices(peer):
    # P TP1 holds 256 B per block (all heads); D TP2 ranks hold 128 B each.
    eid = f"tp-split-{next(_n)}"
    p_spec = EngineSpec(eid, _regions(256, mla=False), seed=60)
    p_desc = peer.call("create", p_spec)
    peer.call("register", p_spec.key, ["heads-1"])
    sides, engines = [], []
    try:
        for rank in range(2):
            d = LocalSide(EngineSpec(f"d-{eid}", _regions(128, mla=False), tp_rank=rank,
                                     tp_size=2))
            e = PullEngine(d.local, timeout_s=10)
            e.add_remote(p_desc)
            peer.call("add_peer", p_spec.key, d.describe())
            sides.append(d)
            engines.append(e)
        befores = [d.memory.snapshot() for d in sides]
        for e in engines:
            e.start(PullRequest("heads-1", eid, [[1, 4]], [[5, 0]]))
        mirror = _mirror(p_spec)
        for rank, (d, e) in enumerate(zip(sides, engines, strict=True)):
            assert isinstance(e.wait("heads-1"), TransferDone)
            _assert(d, expected_after(d.memory, befores[rank], mirror, {
                n: [(1 * 128, 5 * 256 + rank * 128, 128), (4 * 128, 0 + rank * 128, 128)]
                for n in NAMES}))
        state = peer.wait_notifs(p_spec.key, lambda st: "heads-1" in st["finished"])
        assert [m for _, m in state["log"]] == ["heads-1:2", "heads-1:2"]
    finally:
        for e in engines:
            e.close()
        for d in sides:
            d.close()
        peer.call("close", p_spec.key)


def test_fewer_decode_ranks_split_reads_across_producer_ranks(peer):
    # P TP2 ranks hold 64 B head slices; D TP1 holds 128 B blocks (slice i from rank i).
    eid = f"tp-join-{next(_n)}"
    p_specs = [EngineSpec(eid, _regions(64, mla=False), tp_rank=r, tp_size=2, seed=70 + r)
               for r in range(2)]
    d = LocalSide(EngineSpec(f"d-{eid}", _regions(128, mla=False)))
    engine = PullEngine(d.local, timeout_s=10)
    try:
        for s in p_specs:
            engine.add_remote(peer.call("create", s))
            peer.call("add_peer", s.key, d.describe())
            peer.call("register", s.key, ["join-1"])
        before = d.memory.snapshot()
        engine.start(PullRequest("join-1", eid, [[0, 7]], [[3, 2]]))
        res = engine.wait("join-1")
        assert isinstance(res, TransferDone) and res.parts == 2, res
        want = before
        for rank, s in enumerate(p_specs):
            want = expected_after(d.memory, want, _mirror(s), {
                n: [(0 * 128 + rank * 64, 3 * 64, 64), (7 * 128 + rank * 64, 2 * 64, 64)]
                for n in NAMES})
        _assert(d, want)
        for s in p_specs:
            state = peer.wait_notifs(s.key, lambda st: "join-1" in st["finished"])
            assert [m for _, m in state["log"]] == ["join-1:1"]
    finally:
        engine.close()
        d.close()
        for s in p_specs:
            peer.call("close", s.key)
