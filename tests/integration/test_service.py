"""AgentService in one process: preflight handshakes, grouped + mixed-memory pulls with
byte-exact checks, peer epoch changes, incompatible peers, typed failures. Real NIXL (UCX
over loopback), real side channel."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

pytest.importorskip("zmq")
from kvbridge_agent import metrics
from kvbridge_agent.geometry import CacheView
from kvbridge_agent.nixl import CPU_TEST_MEM_TYPES, NixlUnavailableError, load_nixl
from kvbridge_agent.service import AgentService, AgentSettings, EngineInfo, PeerRef

try:
    load_nixl()
except NixlUnavailableError:  # pragma: no cover
    pytest.skip("NIXL is not installed", allow_module_level=True)

pytestmark = pytest.mark.nixl

HASH = "a" * 64
NB, BLEN = 16, 512
# (name, group, mem type on decode); prefill keeps every region in VRAM (single type).
LAYOUT = [("model.layers.0.attn", 0, "VRAM"), ("model.layers.1.attn", 0, "VRAM"),
          ("model.layers.2.attn", 1, "VRAM"), ("model.layers.3.attn", 1, "DRAM")]


def make_views(mixed: bool, seed: int | None, *, block_len: int = BLEN):
    bufs, views = [], []
    for i, (name, g, mt) in enumerate(LAYOUT):
        buf = np.zeros(NB * block_len, np.uint8)
        if seed is not None:
            buf[:] = np.random.default_rng([seed, i]).integers(0, 256, buf.size, dtype=np.uint8)
        bufs.append(buf)
        views.append(CacheView.from_range(
            name, buf.ctypes.data, buf.nbytes, group_id=g, num_blocks=NB,
            mem_type=mt if mixed else "VRAM", block_len=block_len, is_mla=True))
    return bufs, views


def service(role: str, views, engine_id: str, *, epoch: int = 1, layout: str = "HND",
            compat: str = HASH) -> AgentService:
    return AgentService(
        views, EngineInfo(engine_id, role, is_mla=True, kv_cache_layout=layout), compat,
        AgentSettings(mem_types=CPU_TEST_MEM_TYPES, epoch=epoch, handshake_timeout_s=3.0,
                      transfer_timeout_s=5.0)).start()


def ref(svc: AgentService, name: str) -> PeerRef:
    e = svc.engine
    return PeerRef(name, e.engine_id, "127.0.0.1", svc.port, e.tp_rank, e.tp_size, svc.epoch,
                   e.role)


@pytest.fixture
def pair():
    pbufs, pviews = make_views(False, seed=7)
    dbufs, dviews = make_views(True, seed=None)
    p = service("prefill", pviews, "P")
    d = service("decode", dviews, "D")
    yield p, pbufs, d, dbufs
    d.close()
    p.close()


def test_preflight_then_grouped_mixed_pull_is_byte_exact(pair) -> None:
    p, pbufs, d, dbufs = pair
    before = metrics.value("kvbridge_agent_handshakes_total", result="succeeded")
    reports = d.set_peers([ref(p, "p-0")])
    assert [r.ok for r in reports] == [True], reports
    assert [r.ok for r in p.set_peers([ref(d, "d-0")])] == [True]
    assert metrics.value("kvbridge_agent_handshakes_total", result="succeeded") == before + 2
    p.hold(["req-1"])
    local = [[1, 2, 3], [5, 6]]
    remote = [[9, 10, 11], [0, 15]]
    res = d.pull("req-1", "P", local, remote)
    assert res.ok, res
    assert res.nbytes == (3 * 2 + 2 * 2) * BLEN
    for i, (_, g, _) in enumerate(LAYOUT):
        for lb, rb in zip(local[g], remote[g], strict=True):
            got = dbufs[i][lb * BLEN:(lb + 1) * BLEN]
            assert np.array_equal(got, pbufs[i][rb * BLEN:(rb + 1) * BLEN])
        untouched = set(range(NB)) - set(local[g])
        for b in untouched:
            assert not dbufs[i][b * BLEN:(b + 1) * BLEN].any()

    def finished():
        return p.completions()["finished"]

    got: list[str] = []
    for _ in range(500):
        got += finished()
        if got:
            break
        import time

        time.sleep(0.01)
    assert got == ["req-1"]


def test_handshake_measures_the_peers_clock(pair) -> None:
    """The offset converts a prefill's lease deadline to the decode's clock. Both agents
    run in this process here, so the true offset is 0: the estimate is within its error."""
    p, _, d, _ = pair
    assert d.clock_offset("P") is None
    assert d.set_peers([ref(p, "p-0")])[0].ok
    clock = d.clock_offset("P")
    assert clock is not None and 0 < clock.error_s < 1.0
    assert abs(clock.offset_s) <= clock.error_s
    assert clock.to_local(100.0) == 100.0 - clock.offset_s
    d.drop_remote("P", "test")
    assert d.clock_offset("P") is None


def test_handshake_is_not_repeated_and_stale_epoch_is_dropped(pair) -> None:
    p, _, d, _ = pair
    r0 = d.set_peers([ref(p, "p-0")])[0]
    loaded = d.loaded_since("P")
    again = d.set_peers([ref(p, "p-0")])[0]
    assert again.time == r0.time and again.agent_name == r0.agent_name
    assert loaded is not None and d.loaded_since("P") == loaded, "the same handshake"
    # The operator says the peer is now at another epoch: old remote dropped, new handshake
    # reaches the same (old) process whose agent name carries epoch 1 -> refused as stale.
    moved = ref(p, "p-0")
    moved = PeerRef(moved.name, moved.engine_id, moved.host, moved.port, 0, 1, 2, "prefill")
    rep = d.set_peers([moved])[0]
    assert not rep.ok and rep.reason == "stale" and not d.peers()
    assert d.loaded_since("P") is None
    res = d.pull("req-x", "P", [[1], [1]], [[1], [1]])
    assert not res.ok and res.cause == "unknown_remote"
    assert d.set_peers([]) == []


def test_pull_with_expected_epoch_mismatch_posts_nothing(pair) -> None:
    p, _, d, dbufs = pair
    assert d.set_peers([ref(p, "p-0")])[0].ok
    res = d.pull("req-s", "P", [[1], [1]], [[1], [1]], expected_epoch=99)
    assert not res.ok and res.cause == "stale_peer"
    assert not any(b.any() for b in dbufs)


def test_incompatible_peer_is_refused_with_the_field() -> None:
    _, pviews = make_views(False, seed=1, block_len=256)
    _, dviews = make_views(False, seed=None)
    p = service("prefill", pviews, "P2")
    d = service("decode", dviews, "D2")
    try:
        rep = d.set_peers([ref(p, "p2-0")])[0]
        assert not rep.ok and rep.reason == "incompatible"
        assert "block_lens" in rep.message
        assert not d.peers()
        other = service("prefill", make_views(False, seed=1)[1], "P3", compat="b" * 64)
        try:
            rep = d.set_peers([ref(other, "p3-0")])[0]
            assert not rep.ok and rep.reason == "incompatible" and "hash" in rep.message.lower()
        finally:
            other.close()
    finally:
        d.close()
        p.close()


def test_unreachable_peer_times_out_within_deadline(pair) -> None:
    _, _, d, _ = pair
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rep = d.set_peers([PeerRef("ghost", "G", "127.0.0.1", port, 0, 1, 1, "prefill")])[0]
    assert not rep.ok and rep.reason == "timeout"


def test_endpoint_spec_matches_registration(pair) -> None:
    _p, _, d, _ = pair
    from kvbridge_agent.kube import endpoint_spec

    spec = endpoint_spec(d, transfer="kvt", pod_name="d-0", pod_uid="u1", node_name="n")
    g = spec["geometry"]
    assert [r["name"] for r in g["regions"]] == [n for n, _, _ in LAYOUT]
    assert [r["memType"] for r in g["regions"]] == [m for _, _, m in LAYOUT]
    assert [r["groupId"] for r in g["regions"]] == [0, 0, 1, 1]
    assert spec["epoch"] == d.epoch and spec["sideChannel"]["port"] == d.port
    assert spec["compatibilityHash"] == HASH and spec["protocolVersion"] == 11


def test_self_inconsistent_peer_is_refused_with_the_field() -> None:
    """A reply that decodes but describes no possible engine (per-region lists of different
    lengths) is refused at the handshake, before anything is loaded into NIXL."""
    import msgspec

    from kvbridge_agent.protocol import decode_metadata, encode_payload, make_payload
    from kvbridge_agent.sidechannel import SideChannelServer
    from spec_vectors import load_vectors

    example = load_vectors("v11-handshake.json")["examples"][0]
    meta = decode_metadata(bytes.fromhex(example["metadata_msgpack_hex"]))
    broken = msgspec.structs.replace(meta, engine_id="P4", region_num_blocks=[16, 8, 8])
    _, dviews = make_views(False, seed=None)
    d = service("decode", dviews, "D4")
    try:
        with SideChannelServer({(0, 0): encode_payload(make_payload(broken, HASH))},
                               host="127.0.0.1", port=0) as srv:
            rep = d.set_peers([PeerRef("p4-0", "P4", "127.0.0.1", srv.port, 0, 1, None,
                                       "prefill")])[0]
        assert not rep.ok and rep.reason == "incompatible"
        assert "len(region_num_blocks): expected 2 (one entry per region" in rep.message
        assert not d.peers()
    finally:
        d.close()
