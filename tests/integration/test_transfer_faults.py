"""Faults: a peer killed mid-transfer, a frozen peer, a restarted peer, bad ids, leases.

A failed read never notifies the producer, always returns a typed failure, and never hangs
(every wait has a deadline)."""

from __future__ import annotations

import itertools
import signal
import time

import numpy as np
import pytest
from _peers import EngineSpec, LocalSide, Memory, Peer, RegionSpec, block_copies, expected_after

from kvbridge_agent.geometry import BlockIdRangeError
from kvbridge_agent.nixl import (
    FailureCause,
    PullEngine,
    PullRequest,
    TransferDone,
    completion_message,
)

pytestmark = pytest.mark.nixl

_n = itertools.count()
TCP = {"UCX_TLS": "tcp"}


def _spec(prefix, regions, **kw):
    return EngineSpec(f"{prefix}-{next(_n)}", regions, **kw)


def _regions(n=4, blocks=16, block_len=256):
    return tuple(RegionSpec(f"model.layers.{i}.attn", num_blocks=blocks, block_len=block_len)
                 for i in range(n))


def _big_regions(mib_per_region=32, n=4):
    block = 1 << 20
    return tuple(RegionSpec(f"model.layers.{i}.attn", num_blocks=mib_per_region,
                            block_len=block) for i in range(n))


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _connect(peer, p_spec, d_spec, *, tls=None, timeout_s=10.0):
    p_desc = peer.call("create", p_spec, lease_s=30.0)
    d = LocalSide(d_spec, tls=tls)
    engine = PullEngine(d.local, timeout_s=timeout_s)
    engine.add_remote(p_desc)
    peer.call("add_peer", p_spec.engine_id, d.describe())
    return d, engine, p_desc


def test_peer_killed_mid_transfer_fails_typed_without_hang():
    peer = Peer(env=TCP)
    p_spec = _spec("pk", _big_regions(), pattern=False)
    d_spec = _spec("dk", _big_regions())
    d, engine, _ = _connect(peer, p_spec, d_spec, tls="tcp")
    try:
        all_blocks = list(range(32))
        engine.start(PullRequest("kill-1", p_spec.engine_id, [all_blocks], [all_blocks]))
        assert engine.in_flight() == ("kill-1",), "transfer finished before the kill"
        peer.kill()
        t0 = time.monotonic()
        res = engine.wait("kill-1", 10.0)
        assert time.monotonic() - t0 < 9.0
        assert res.cause is FailureCause.REMOTE_DISCONNECT, res
        assert engine.in_flight() == ()
        # A new request to the dead peer fails the same way, immediately.
        engine.start(PullRequest("kill-2", p_spec.engine_id, [[0]], [[0]]))
        res2 = engine.wait("kill-2", 5.0)
        assert res2.cause in (FailureCause.REMOTE_DISCONNECT, FailureCause.SETUP), res2
    finally:
        engine.close()
        d.close()
        peer.close()


def test_frozen_peer_hits_the_deadline_and_is_never_notified():
    peer = Peer(env=TCP)
    p_spec = _spec("pf", _big_regions(mib_per_region=4, n=2), pattern=False)
    d_spec = _spec("df", _big_regions(mib_per_region=4, n=2))
    d, engine, _ = _connect(peer, p_spec, d_spec, tls="tcp")
    try:
        peer.call("register", p_spec.engine_id, ["freeze-1"])
        peer.signal(signal.SIGSTOP)
        try:
            engine.start(PullRequest("freeze-1", p_spec.engine_id, [list(range(4))],
                                     [list(range(4))], timeout_s=1.0))
            t0 = time.monotonic()
            res = engine.wait("freeze-1", 5.0)
            waited = time.monotonic() - t0
        finally:
            peer.signal(signal.SIGCONT)
        assert res.cause is FailureCause.TIMEOUT, res
        assert waited < 4.5
        assert engine.in_flight() == ()
        time.sleep(0.2)
        state = peer.call("notifs", p_spec.engine_id)
        assert state["log"] == [] and state["pending"] == ["freeze-1"]
    finally:
        engine.close()
        d.close()
        peer.close()


def test_restarted_peer_with_same_engine_id_is_replaced():
    regions = _regions()
    p_spec = EngineSpec("restart-engine", regions, agent_name="restart-agent", seed=41)
    d_spec = _spec("dr", regions)
    first = Peer()
    d, engine, _ = _connect(first, p_spec, d_spec)
    second = None
    try:
        before = d.memory.snapshot()
        engine.start(PullRequest("r-1", p_spec.engine_id, [[1, 2]], [[3, 4]]))
        assert isinstance(engine.wait("r-1", 5.0), TransferDone)
        first.kill()
        engine.start(PullRequest("r-2", p_spec.engine_id, [[5]], [[6]]))
        assert engine.wait("r-2", 5.0).cause is FailureCause.REMOTE_DISCONNECT
        # Same engine id and agent name, new process, new memory contents.
        second = Peer()
        p2 = EngineSpec("restart-engine", regions, agent_name="restart-agent", seed=42)
        desc2 = second.call("create", p2)
        engine.add_remote(desc2)          # drops the stale agent and its prepared lists
        second.call("add_peer", p2.engine_id, d.describe())
        second.call("register", p2.engine_id, ["r-3"])
        engine.start(PullRequest("r-3", p2.engine_id, [[7, 8]], [[9, 10]]))
        assert isinstance(engine.wait("r-3", 5.0), TransferDone)
        m1, m2 = Memory(p_spec), Memory(p2)
        m1.fill_pattern(41)
        m2.fill_pattern(42)
        names = [r.name for r in regions]
        want = expected_after(d.memory, before, m1, block_copies(
            d_spec, p_spec, {n: [(1, 3), (2, 4)] for n in names}))
        want = expected_after(d.memory, want, m2, block_copies(
            d_spec, p2, {n: [(7, 9), (8, 10)] for n in names}))
        for name, buf in d.memory.buffers.items():
            np.testing.assert_array_equal(buf, want[name], err_msg=name)
        second.wait_notifs(p2.engine_id, lambda s: "r-3" in s["finished"])
    finally:
        engine.close()
        d.close()
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("side", ["local", "remote"])
def test_out_of_range_ids_fail_before_posting(peer, side):
    regions = _regions(blocks=8)
    p_spec = _spec("po", regions)
    d_spec = _spec("do", regions)
    d, engine, _ = _connect(peer, p_spec, d_spec)
    try:
        peer.call("register", p_spec.engine_id, ["oor"])
        posts = []
        orig = d.agent.post
        d.agent.post = lambda x, notif=b"": posts.append(x) or orig(x, notif)
        before = d.memory.snapshot()
        local, remote = ([1, 8], [1, 2]) if side == "local" else ([1, 2], [1, 99])
        engine.start(PullRequest("oor", p_spec.engine_id, [local], [remote]))
        res = engine.wait("oor", 5.0)
        assert res.cause is FailureCause.INVALID_REQUEST, res
        assert isinstance(res.error, BlockIdRangeError)
        assert "out of range" in res.message
        assert posts == []
        for name, buf in d.memory.buffers.items():
            np.testing.assert_array_equal(buf, before[name])
        time.sleep(0.1)
        assert peer.call("notifs", p_spec.engine_id)["log"] == []
    finally:
        engine.close()
        d.close()
        peer.call("close", p_spec.engine_id)


def test_unknown_remote_engine_is_a_typed_failure(peer):
    d = LocalSide(_spec("du", _regions()))
    engine = PullEngine(d.local)
    try:
        engine.start(PullRequest("nobody", "no-such-engine", [[1]], [[1]]))
        res = engine.wait("nobody", 1.0)
        assert res.cause is FailureCause.UNKNOWN_REMOTE
        assert "no-such-engine" in res.message
    finally:
        engine.close()
        d.close()


def test_lease_expires_without_notification_and_heartbeats_extend(peer):
    regions = _regions()
    p_spec = _spec("pl", regions)
    d_spec = _spec("dl", regions)
    p_desc = peer.call("create", p_spec, lease_s=3.0)
    d = LocalSide(d_spec)
    engine = PullEngine(d.local, lease_s=3.0)
    engine.add_remote(p_desc)
    peer.call("add_peer", p_spec.engine_id, d.describe())
    try:
        peer.call("register", p_spec.engine_id, ["lease-short"], lease_s=0.3)
        peer.call("register", p_spec.engine_id, ["lease-hb"])
        state = peer.wait_notifs(p_spec.engine_id, lambda s: "lease-short" in s["expired"])
        assert "lease-short" not in state["finished"]
        # A late completion for the expired request is ignored (logged once).
        d.agent.send_notif(p_desc.agent_name, completion_message("lease-short", 1))
        # Heartbeat lease-hb once a third of its lease has passed: the lease moves out.
        engine.expect("lease-hb", p_spec.engine_id)
        time.sleep(1.2)
        left_before = peer.call("remaining_lease", p_spec.engine_id, "lease-hb")
        assert engine.heartbeats.tick(force=True) == 1
        deadline = time.monotonic() + 5
        while True:
            left = peer.call("notifs", p_spec.engine_id)
            left_after = peer.call("remaining_lease", p_spec.engine_id, "lease-hb")
            if left_after is not None and left_after > left_before + 0.2:
                break
            assert time.monotonic() < deadline, "heartbeat did not extend the lease"
            time.sleep(0.01)
        assert left_after <= 2.0 + 0.05            # extended to now + lease * 2/3
        assert "lease-short" not in left["finished"]
        assert [m for _, m in left["log"]] == ["lease-short:1", "HB:lease-hb"]
    finally:
        engine.close()
        d.close()
        peer.call("close", p_spec.engine_id)


def test_a_first_read_from_a_frozen_prefill_waits_for_it_without_blocking_the_caller():
    """A prefill starved of CPU (the 2-core machines' TP "hang", docs/limits.md: Known limitations).
    With the default transports, the decode's first READ needs the prefill's process to answer
    UCX's wire-up, so it cannot complete while the prefill does not run (cma may already have
    copied the bytes). Loading the prefill and posting the READ return without waiting for
    it, every poll returns, and the READ fails at its deadline with cause timeout, never
    notifying; nothing lands in its blocks after that, and once the prefill runs again the
    next READ is byte exact."""
    regions = _regions()
    p_spec = EngineSpec(f"pw-{next(_n)}", regions, seed=43)
    d_spec = _spec("dw", regions)
    peer = Peer()
    d = None
    try:
        p_desc = peer.call("create", p_spec, lease_s=30.0)
        d = LocalSide(d_spec)
        engine = PullEngine(d.local, timeout_s=10.0)
        peer.call("register", p_spec.engine_id, ["wire-1", "wire-2"])
        before = d.memory.snapshot()
        peer.signal(signal.SIGSTOP)
        polls, result = 0, None
        try:
            engine.add_remote(p_desc)
            engine.start(PullRequest("wire-1", p_spec.engine_id, [[1, 2]], [[3, 4]],
                                     timeout_s=1.0))
            while result is None:          # what an engine's step loop does
                ended = engine.poll()
                polls += 1
                result = next((r for r in (*ended.finished, *ended.failed)
                               if r.request_id == "wire-1"), None)
                time.sleep(0.001)
            at_failure = d.memory.snapshot()
        finally:
            peer.signal(signal.SIGCONT)
        assert result.cause is FailureCause.TIMEOUT, result
        assert "in flight" in result.message, result.message
        assert polls > 10                  # the caller kept control while the READ waited
        peer.call("add_peer", p_spec.engine_id, d.describe())
        time.sleep(0.5)
        assert peer.call("notifs", p_spec.engine_id)["log"] == []   # never notified
        m = Memory(p_spec)
        m.fill_pattern(43)
        copies = {r.name: [(1, 3), (2, 4)] for r in regions}
        landed = expected_after(d.memory, before, m, block_copies(d_spec, p_spec, copies))
        for name, buf in d.memory.buffers.items():
            # the failed READ's blocks: as they were, or the prefill's bytes; then frozen
            assert (np.array_equal(at_failure[name], before[name])
                    or np.array_equal(at_failure[name], landed[name])), name
            np.testing.assert_array_equal(buf, at_failure[name], err_msg=name)

        engine.start(PullRequest("wire-2", p_spec.engine_id, [[5, 6]], [[7, 8]]))
        assert isinstance(engine.wait("wire-2", 5.0), TransferDone)
        want = expected_after(d.memory, at_failure, m, block_copies(
            d_spec, p_spec, {r.name: [(5, 7), (6, 8)] for r in regions}))
        for name, buf in d.memory.buffers.items():
            np.testing.assert_array_equal(buf, want[name], err_msg=name)
        engine.close()
    finally:
        if d is not None:
            d.close()
        peer.close()
