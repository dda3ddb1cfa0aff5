"""Mixed DRAM/VRAM pulls (spec §4.6-§4.8): one transfer per memory-type pair, no
notification attached to any part, exactly one notification after the last part, none on
failure. On CPU both kinds are DRAM pools (CPU_TEST_MEM_TYPES), the split is the same."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from _peers import EngineSpec, LocalSide, Memory, Peer, RegionSpec, block_copies, expected_after

from kvbridge_agent.nixl import (
    FailureCause,
    NixlCallError,
    PullEngine,
    PullRequest,
    TransferDone,
    XferState,
)

pytestmark = pytest.mark.nixl

_n = itertools.count()
NAMES = [f"model.layers.{i}.attn" for i in range(6)]


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _engine(prefix, mems, caps, seed=1):
    regs = tuple(RegionSpec(NAMES[i], num_blocks=c, block_len=96, mem_type=m)
                 for i, (m, c) in enumerate(zip(mems, caps, strict=True)))
    return EngineSpec(f"{prefix}-{next(_n)}", regs, seed=seed)


class Spy:
    """Records the D agent's transfer calls; can delay completion or fail a post."""

    def __init__(self, agent, *, slow_first: int = 0, fail_post: int | None = None):
        self.agent, self.events = agent, []
        self.slow_left = slow_first
        self.slow_handle = None
        self.fail_post = fail_post
        self.posts = 0
        for name in ("make_prepped", "make_direct", "post", "state", "send_notif"):
            setattr(self, "_" + name, getattr(agent, name))
            setattr(agent, name, getattr(self, name))

    def make_prepped(self, op, local, lids, remote, rids, *, notif=b"", label=""):
        self.events.append(("make", label, notif))
        return self._make_prepped(op, local, lids, remote, rids, notif=notif, label=label)

    def make_direct(self, op, lrows, rrows, kinds, peer, *, notif=b"", label=""):
        self.events.append(("make", label, notif))
        return self._make_direct(op, lrows, rrows, kinds, peer, notif=notif, label=label)

    def post(self, x, notif=b""):
        self.posts += 1
        self.events.append(("post", x.label, notif))
        if self.fail_post == self.posts:
            raise NixlCallError("injected post failure", FailureCause.TRANSFER)
        state = self._post(x, notif)
        if self.slow_left and self.slow_handle is None:
            self.slow_handle = x
            return XferState.IN_PROGRESS
        return state

    def state(self, x):
        if x is self.slow_handle and self.slow_left:
            self.slow_left -= 1
            return XferState.IN_PROGRESS
        self.events.append(("done", x.label))
        return self._state(x)

    def send_notif(self, peer, message):
        self.events.append(("notif", peer, message))
        return self._send_notif(peer, message)


def _setup(peer, p_spec, d_spec):
    p_desc = peer.call("create", p_spec)
    d = LocalSide(d_spec)
    engine = PullEngine(d.local, timeout_s=10.0)
    engine.add_remote(p_desc)
    peer.call("add_peer", p_spec.engine_id, d.describe())
    mirror = Memory(p_spec)
    mirror.fill_pattern(p_spec.seed)
    return d, engine, mirror


def _teardown(peer, p_spec, d, engine):
    engine.close()
    d.close()
    peer.call("close", p_spec.engine_id)


def _check_bytes(d, before, mirror, copies):
    want = expected_after(d.memory, before, mirror, copies)
    for name, buf in d.memory.buffers.items():
        np.testing.assert_array_equal(buf, want[name], err_msg=name)


def test_mixed_local_split_into_two_parts_one_notification_after_both(peer):
    p_spec = _engine("p", ["VRAM"] * 3, [8, 8, 8], seed=21)
    d_spec = _engine("d", ["VRAM", "DRAM", "VRAM"], [4, 6, 4])
    d, engine, mirror = _setup(peer, p_spec, d_spec)
    try:
        spy = Spy(d.agent, slow_first=3)
        peer.call("register", p_spec.engine_id, ["mix-1"])
        before = d.memory.snapshot()
        engine.start(PullRequest("mix-1", p_spec.engine_id, [[1, 2]], [[5, 6]]))
        assert engine.poll().finished == ()                # part 1 still "in flight"
        time.sleep(0.05)
        assert peer.call("notifs", p_spec.engine_id)["log"] == []
        deadline = time.monotonic() + 5
        finished = ()
        while not finished and time.monotonic() < deadline:
            finished = engine.poll().finished
        assert len(finished) == 1 and finished[0].parts == 2
        state = peer.wait_notifs(p_spec.engine_id, lambda s: "mix-1" in s["finished"])
        assert [m for _, m in state["log"]] == ["mix-1:1"]
        # No part carried a notification; the one notification came after every part.
        assert all(e[2] == b"" for e in spy.events if e[0] in ("make", "post"))
        kinds = sorted(e[1].split()[1].split("@")[0] for e in spy.events if e[0] == "post")
        assert kinds == ["DRAM<-VRAM", "VRAM<-VRAM"]
        notif_at = next(i for i, e in enumerate(spy.events) if e[0] == "notif")
        assert notif_at == len(spy.events) - 1
        assert any(e[0] == "done" for e in spy.events[:notif_at])
        _check_bytes(d, before, mirror, block_copies(
            d_spec, p_spec, {n.name: [(1, 5), (2, 6)] for n in d_spec.regions}))
    finally:
        _teardown(peer, p_spec, d, engine)


def test_both_sides_mixed_one_part_per_pair(peer):
    p_spec = _engine("p", ["DRAM", "VRAM", "VRAM", "DRAM", "DRAM", "VRAM"], [9] * 6, seed=22)
    d_spec = _engine("d", ["VRAM", "VRAM", "DRAM", "DRAM", "VRAM", "VRAM"], [7, 8, 9, 7, 8, 9])
    d, engine, mirror = _setup(peer, p_spec, d_spec)
    try:
        spy = Spy(d.agent)
        peer.call("register", p_spec.engine_id, ["mix-4"])
        before = d.memory.snapshot()
        engine.start(PullRequest("mix-4", p_spec.engine_id, [[0, 3, 6]], [[8, 1, 2]]))
        res = engine.wait("mix-4", 5.0)
        assert isinstance(res, TransferDone), res
        pairs = sorted(e[1].split()[1].split("@")[0] for e in spy.events if e[0] == "post")
        assert pairs == ["DRAM<-DRAM", "DRAM<-VRAM", "VRAM<-DRAM", "VRAM<-VRAM"]
        assert res.parts == 4
        _check_bytes(d, before, mirror, block_copies(
            d_spec, p_spec, {n.name: [(0, 8), (3, 1), (6, 2)] for n in d_spec.regions}))
        state = peer.wait_notifs(p_spec.engine_id, lambda s: "mix-4" in s["finished"])
        assert [m for _, m in state["log"]] == ["mix-4:1"]
    finally:
        _teardown(peer, p_spec, d, engine)


def test_failed_part_stops_siblings_and_sends_nothing(peer):
    p_spec = _engine("p", ["DRAM", "VRAM", "VRAM", "DRAM", "DRAM", "VRAM"], [9] * 6, seed=23)
    d_spec = _engine("d", ["VRAM", "VRAM", "DRAM", "DRAM", "VRAM", "VRAM"], [9] * 6)
    d, engine, _ = _setup(peer, p_spec, d_spec)
    try:
        spy = Spy(d.agent, fail_post=2)
        peer.call("register", p_spec.engine_id, ["mix-fail"])
        engine.start(PullRequest("mix-fail", p_spec.engine_id, [[0, 1]], [[2, 3]]))
        res = engine.wait("mix-fail", 5.0)
        assert res.cause is FailureCause.TRANSFER and "injected" in res.message
        assert spy.posts == 2                              # parts 3 and 4 never posted
        assert not any(e[0] == "notif" for e in spy.events)
        time.sleep(0.1)
        state = peer.call("notifs", p_spec.engine_id)
        assert state["log"] == [] and state["pending"] == ["mix-fail"]
        assert engine.in_flight() == ()
    finally:
        _teardown(peer, p_spec, d, engine)
