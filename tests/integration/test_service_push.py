"""AgentService in push mode (spec §5): the prefill agent WRITEs a request's blocks into a
preflighted decode agent and the completion notification travels with the WRITE; the decode
agent expects the request and learns of completion from the notification.

The decode agent runs in its own (spawned) process, so the WRITE crosses a process boundary
and killing the peer is a real crash. Real NIXL (UCX over loopback), real side channel.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

pytest.importorskip("zmq")
from kvbridge_agent.geometry import CacheView, GeometryError
from kvbridge_agent.nixl import (
    CPU_TEST_MEM_TYPES,
    NixlUnavailableError,
    UnsupportedTransferError,
    load_nixl,
)
from kvbridge_agent.service import AgentService, AgentSettings, EngineInfo, PeerRef

try:
    load_nixl()
except NixlUnavailableError:  # pragma: no cover
    pytest.skip("NIXL is not installed", allow_module_level=True)

pytestmark = pytest.mark.nixl

HASH = "d" * 64
NB, BLEN = 16, 512
SEED = 5
GROUPS = (0, 0, 1, 1)        # four regions in two transfer groups
MIXED_MESSAGE = "NixlPushConnector does not support mixed-memory KV caches"
LAYOUT_MESSAGE = ("NixlPushConnector does not support different producer and consumer "
                  "cache-group layouts")


def make_views(seed: int | None, *, groups=GROUPS, mem=("VRAM",) * 4):
    bufs, views = [], []
    for i, g in enumerate(groups):
        buf = np.zeros(NB * BLEN, np.uint8)
        if seed is not None:
            buf[:] = np.random.default_rng([seed, i]).integers(0, 256, buf.size, dtype=np.uint8)
        bufs.append(buf)
        views.append(CacheView.from_range(
            f"model.layers.{i}.attn", buf.ctypes.data, buf.nbytes, group_id=g,
            num_blocks=NB, mem_type=mem[i], block_len=BLEN, is_mla=True))
    return bufs, views


def service(role: str, views, engine_id: str, *, mode: str = "push", epoch: int = 1,
            start: bool = True) -> AgentService:
    svc = AgentService(
        views, EngineInfo(engine_id, role, is_mla=True, mode=mode), HASH,
        AgentSettings(mem_types=CPU_TEST_MEM_TYPES, epoch=epoch, handshake_timeout_s=3.0,
                      transfer_timeout_s=5.0))
    return svc.start() if start else svc


def ref_of(name: str, engine_id: str, role: str, port: int, epoch: int) -> PeerRef:
    return PeerRef(name, engine_id, "127.0.0.1", port, 0, 1, epoch, role)


# -- the decode agent, in a spawned process -----------------------------------------------------
def _decode_main(conn: Any, engine_id: str, epoch: int) -> None:
    """Child: a push-mode decode AgentService over zeroed memory, driven over a pipe."""
    bufs, views = make_views(None)
    svc = service("decode", views, engine_id, epoch=epoch)
    conn.send({"port": svc.port, "epoch": svc.epoch, "agent": svc.agent_name})
    try:
        while True:
            cmd, kw = conn.recv()
            try:
                if cmd == "close":
                    conn.send(None)
                    return
                if cmd == "set_peers":
                    out: Any = [(r.ok, r.reason, r.message) for r in
                                svc.set_peers([PeerRef(**p) for p in kw["peers"]])]
                elif cmd == "expect":
                    svc.expect(kw["rid"], kw["ids"])
                    out = True
                elif cmd == "wait":
                    r = svc.wait_received(kw["rid"], kw.get("timeout_s", 5.0))
                    out = (r.ok, r.cause, r.message)
                elif cmd == "completions":
                    out = svc.completions()
                elif cmd == "notifications":
                    out = svc.notifications_received
                elif cmd == "memory":
                    out = [b.tobytes() for b in bufs]
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(out)
            except Exception as exc:
                conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
    finally:
        svc.close()


class DecodeProcess:
    def __init__(self, engine_id: str = "D", epoch: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, engine_id, epoch),
                                daemon=True)
        self.proc.start()
        child.close()
        self.engine_id = engine_id
        self.info = self._recv(60.0)

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"decode process: no answer within {timeout} s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, cmd: str, timeout: float = 30.0, **kw: Any) -> Any:
        self.conn.send((cmd, kw))
        return self._recv(timeout)

    def ref(self, name: str = "d-0") -> PeerRef:
        return ref_of(name, self.engine_id, "decode", self.info["port"], self.info["epoch"])

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.call("close", timeout=15)
            self.proc.join(15)
        self.kill()


def prefill_ref(p: AgentService, name: str = "p-0") -> dict:
    return dict(name=name, engine_id=p.engine.engine_id, host="127.0.0.1", port=p.port,
                tp_rank=0, tp_size=1, epoch=p.epoch, role="prefill")


@pytest.fixture
def push_pair():
    pbufs, pviews = make_views(SEED)
    p = service("prefill", pviews, "P")
    d = DecodeProcess()
    try:
        yield p, pbufs, d
    finally:
        d.close()
        p.close()


def preflight(p: AgentService, d: DecodeProcess) -> None:
    # P writes into D's memory: it needs D's metadata (loaded into its PushEngine).
    assert [(r.ok, r.reason) for r in p.set_peers([d.ref()])] == [(True, "succeeded")]
    assert p.peers() == {"d-0": d.ref()}
    # D loads P's NIXL agent, which accepting P's WRITE notifications needs.
    assert [x[0] for x in d.call("set_peers", peers=[prefill_ref(p)])] == [True]


def test_push_scattered_blocks_byte_exact_and_exactly_one_completion(push_pair) -> None:
    p, pbufs, d = push_pair
    preflight(p, d)
    mine = [[3, 4, 5, 15], [0, 9]]       # prefill block ids per group (scattered)
    theirs = [[12, 1, 7, 2], [14, 6]]    # decode block ids per group
    d.call("expect", rid="req-1", ids=theirs)
    res = p.push("req-1", "D", mine, theirs, expected_epoch=d.info["epoch"])
    assert res.ok, res
    assert res.nbytes == 4 * BLEN * 2 + 2 * BLEN * 2    # two regions per group
    assert d.call("wait", rid="req-1") == (True, "", "")
    memory = [np.frombuffer(b, np.uint8) for b in d.call("memory")]
    for i, g in enumerate(GROUPS):
        for pb, db in zip(mine[g], theirs[g], strict=True):
            np.testing.assert_array_equal(memory[i][db * BLEN:(db + 1) * BLEN],
                                          pbufs[i][pb * BLEN:(pb + 1) * BLEN],
                                          err_msg=f"region {i} block {db}")
        for b in set(range(NB)) - set(theirs[g]):
            assert not memory[i][b * BLEN:(b + 1) * BLEN].any(), f"region {i} block {b}"
    assert d.call("completions") == {"finished": ["req-1"], "expired": []}
    time.sleep(0.3)     # a second notification would arrive and be counted by now
    assert d.call("notifications") == 1
    assert d.call("completions") == {"finished": [], "expired": []}
    assert p.completions() == {"finished": [], "expired": []}   # P waits for nothing


def test_push_typed_refusals_before_posting(push_pair) -> None:
    p, _, d = push_pair
    # Not preflighted: the request path never handshakes.
    res = p.push("req-u", "D", [[1], [1]], [[1], [1]])
    assert not res.ok and res.cause == "unknown_remote", res
    preflight(p, d)
    res = p.push("req-s", "D", [[1], [1]], [[1], [1]], expected_epoch=d.info["epoch"] + 1)
    assert not res.ok and res.cause == "stale_peer", res
    res = p.push("req-r", "D", [[1], [1]], [[NB], [1]])
    assert not res.ok and res.cause == "invalid_request", res
    with pytest.raises(RuntimeError, match="pull needs a decode agent in pull mode"):
        p.pull("x", "D", [[1], [1]], [[1], [1]])
    with pytest.raises(RuntimeError, match="BlockIdRangeError"):
        d.call("expect", rid="req-bad", ids=[[NB], [0]])
    assert d.call("notifications") == 0


def test_expect_checks_local_block_ids() -> None:
    _, views = make_views(None)
    d = service("decode", views, "D0")
    try:
        with pytest.raises(GeometryError):
            d.expect("r", [[0, NB], [1]])
        d.expect("r", [[0, 1], [1]])
        res = d.wait_received("r", timeout_s=0.2)
        assert not res.ok and res.cause == "timeout"
        with pytest.raises(RuntimeError, match="push needs a prefill agent in push mode"):
            d.push("r", "P", [[0]], [[0]])
    finally:
        d.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mixed_memory_push_agent_is_refused_at_start(role: str) -> None:
    _, views = make_views(SEED, mem=("VRAM", "VRAM", "VRAM", "DRAM"))
    svc = service(role, views, f"M-{role}", start=False)
    with pytest.raises(UnsupportedTransferError, match=MIXED_MESSAGE):
        svc.start()
    svc.close()
    # The same memory in pull mode is fine (mixed DRAM/VRAM pull, spec §4.6).
    if role == "decode":
        service(role, views, "M-pull", mode="pull").close()


def test_push_preflight_refuses_mixed_memory_and_other_group_layouts() -> None:
    _, pviews = make_views(SEED)
    p = service("prefill", pviews, "P1")
    # A mixed-memory decode engine (it can only be in pull mode; a vLLM or foreign pod could
    # still be pointed at a push producer): refused with the spec's message, nothing loaded.
    _, mviews = make_views(None, mem=("VRAM", "VRAM", "VRAM", "DRAM"))
    mixed = service("decode", mviews, "DM", mode="pull")
    _, gviews = make_views(None, groups=(0, 1, 0, 1))
    other = service("decode", gviews, "DG")
    try:
        rep = p.set_peers([ref_of("dm-0", "DM", "decode", mixed.port, mixed.epoch)])[0]
        assert not rep.ok and rep.reason == "incompatible", rep
        assert MIXED_MESSAGE in rep.message, rep.message
        assert not p.peers()
        rep = p.set_peers([ref_of("dg-0", "DG", "decode", other.port, other.epoch)])[0]
        assert not rep.ok and rep.reason == "incompatible", rep
        assert LAYOUT_MESSAGE in rep.message and "region_group_ids" in rep.message, rep.message
        assert not p.peers()
        res = p.push("r", "DG", [[1], [1]], [[1], [1]])
        assert not res.ok and res.cause == "unknown_remote"
    finally:
        other.close()
        mixed.close()
        p.close()


def test_push_to_killed_peer_fails_typed_without_completion(push_pair) -> None:
    p, _, d = push_pair
    preflight(p, d)
    d.call("expect", rid="ok-1", ids=[[1], [2]])
    assert p.push("ok-1", "D", [[1], [2]], [[1], [2]]).ok
    assert d.call("wait", rid="ok-1")[0]
    d.call("expect", rid="dead-1", ids=[[3], [4]])
    d.kill()
    started = time.monotonic()
    res = p.push("dead-1", "D", [[3], [4]], [[3], [4]], timeout_s=3.0)
    assert not res.ok, res
    assert res.cause in ("remote_disconnect", "setup"), res
    assert time.monotonic() - started < 3.0 + 6.0      # within the deadline (+ poll slack)
    assert p.push_engine.in_flight() == ()
    assert p.completions() == {"finished": [], "expired": []}
