"""Real side-channel server (thread) and real REQ client over 127.0.0.1, ephemeral ports."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbridge_agent.protocol import (
    HashMismatchError,
    NixlAgentMetadata,
    decode_metadata,
    encode_payload,
    encode_request,
    encode_timestamp,
    make_payload,
)
from kvbridge_agent.sidechannel import (
    HOST_ENV,
    PORT_ENV,
    HandshakeTimeoutError,
    RemoteRejectedError,
    ReplyFormatError,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    fetch_metadata,
    side_channel_address,
)
from spec_vectors import load_vectors

VECTORS = load_vectors("v11-handshake.json")
PAYLOAD = bytes.fromhex(VECTORS["examples"][0]["payload_msgpack_hex"])
HASH = VECTORS["examples"][0]["payload_compatibility_hash"]
LOOPBACK = "127.0.0.1"
DEADLINE = 0.5


def rank_payload(pp: int, tp: int) -> bytes:
    meta = decode_metadata(bytes.fromhex(VECTORS["examples"][0]["metadata_msgpack_hex"]))
    meta = NixlAgentMetadata(
        **{f: getattr(meta, f) for f in meta.__struct_fields__}
        | {"device_id": tp, "engine_id": "prefill-a"}
    )
    return encode_payload(make_payload(meta, HASH))


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    payloads = {(pp, tp): rank_payload(pp, tp) for pp in range(2) for tp in range(2)}
    with SideChannelServer(payloads, host=LOOPBACK, port=0) as srv:
        yield srv
    assert not srv.running


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def test_fetch_all_ranks_decodes_and_keeps_lowest_rtt_offset(server: SideChannelServer) -> None:
    targets = [(pp, tp) for pp in range(2) for tp in range(2)]
    result = fetch_metadata(
        LOOPBACK, server.port, targets, timeout_s=5, local_hash=HASH, expected_engine_id="prefill-a"
    )
    assert [(r.pp_rank, r.tp_rank) for r in result.replies] == targets
    assert [r.metadata.device_id for r in result.replies] == [0, 1, 0, 1]
    assert result.metadata(1, 1).region_names == ["model.layers.0.attn", "model.layers.1.attn"]
    assert result.best is min(result.replies, key=lambda r: r.rtt)
    assert result.clock_offset == result.best.clock_offset
    for r in result.replies:
        # Same process, same perf_counter: the server stamped between our send and receive.
        assert r.t_send <= r.remote_time <= r.t_recv
        assert abs(r.clock_offset) <= r.rtt / 2
    assert server.stats() == {"ok": 4}


def test_reply_frames_are_payload_then_float64(server: SideChannelServer) -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        sock.send(encode_request(0, 1))
        assert sock.poll(5000)
        first, second = sock.recv_multipart()
    assert first == rank_payload(0, 1)
    assert second[0] == 0xCB and len(second) == 9


def test_unknown_rank_is_rejected_and_server_keeps_serving(server: SideChannelServer) -> None:
    with SideChannelClient() as client:
        with pytest.raises(RemoteRejectedError, match=r"unknown_rank.*\(0, 7\)") as err:
            client.fetch(LOOPBACK, server.port, [(0, 7)], timeout_s=5)
        assert err.value.kind == "unknown_rank"
        assert client.fetch(LOOPBACK, server.port, [(1, 0)], timeout_s=5).replies
    assert server.stats() == {"unknown_rank": 1, "ok": 1}


def test_hash_mismatch_is_typed(server: SideChannelServer) -> None:
    with pytest.raises(HashMismatchError, match="enforce_handshake_compat"):
        fetch_metadata(LOOPBACK, server.port, timeout_s=5, local_hash="0" * 64)
    result = fetch_metadata(
        LOOPBACK, server.port, timeout_s=5, local_hash="0" * 64, enforce_handshake_compat=False
    )
    assert result.metadata().engine_id == "prefill-a"


def test_silent_server_times_out_within_deadline() -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.ROUTER) as silent:
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port(f"tcp://{LOOPBACK}")
        start = time.monotonic()
        with pytest.raises(HandshakeTimeoutError) as err:
            fetch_metadata(LOOPBACK, port, timeout_s=DEADLINE)
        elapsed = time.monotonic() - start
    assert elapsed < 10 * DEADLINE
    assert err.value.connected is True
    assert "connected, but the server did not answer" in str(err.value)
    assert f"within the {DEADLINE:g} s deadline" in str(err.value)
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, SideChannelError)


def test_closed_port_times_out_within_deadline() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(HandshakeTimeoutError) as err:
        fetch_metadata(LOOPBACK, port, timeout_s=DEADLINE)
    assert time.monotonic() - start < 10 * DEADLINE
    assert err.value.connected is False
    assert f"tcp://{LOOPBACK}:{port}" in str(err.value) and "never connected" in str(err.value)


def test_timed_out_socket_is_discarded_and_client_recovers() -> None:
    """A server that ignores the first request: the REQ socket must not be reused."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{LOOPBACK}")
    stop = threading.Event()

    def serve() -> None:
        seen = 0
        while not stop.is_set():
            if router.poll(50):
                frames = router.recv_multipart()
                seen += 1
                if seen > 1:
                    router.send_multipart(
                        [*frames[:2], PAYLOAD, encode_timestamp(time.perf_counter())]
                    )
        router.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with SideChannelClient() as client:
            with pytest.raises(HandshakeTimeoutError):
                client.fetch(LOOPBACK, port, timeout_s=DEADLINE)
            result = client.fetch(LOOPBACK, port, timeout_s=5)
            assert result.metadata().engine_id == "decode-0"
    finally:
        stop.set()
        thread.join(5)


def test_wrong_reply_frame_count_is_typed() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{LOOPBACK}")

    def answer_once() -> None:
        if router.poll(5000):
            frames = router.recv_multipart()
            router.send_multipart([*frames[:2], PAYLOAD])  # no timestamp frame
        router.close(0)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    with pytest.raises(ReplyFormatError, match="expected 2 reply frames"):
        fetch_metadata(LOOPBACK, port, timeout_s=5)
    thread.join(5)


def test_environment_address_and_dp_index(monkeypatch: pytest.MonkeyPatch) -> None:
    assert side_channel_address(environ={}) == ("localhost", 5600)
    assert side_channel_address(2, environ={}) == ("localhost", 5602)
    env = {HOST_ENV: "10.1.2.3", PORT_ENV: "7000"}
    assert side_channel_address(1, environ=env) == ("10.1.2.3", 7001)
    assert side_channel_address(1, host="h", port=9000, environ=env) == ("h", 9001)
    with pytest.raises(SideChannelError, match=PORT_ENV + ": expected an integer port"):
        side_channel_address(environ={PORT_ENV: "x"})
    base = free_port() - 1
    monkeypatch.setenv(HOST_ENV, LOOPBACK)
    monkeypatch.setenv(PORT_ENV, str(base))
    with SideChannelServer({(0, 0): PAYLOAD}, dp_index=1) as srv:
        assert srv.endpoint == f"tcp://{LOOPBACK}:{base + 1}"
        assert fetch_metadata(LOOPBACK, base + 1, timeout_s=5).metadata().engine_id == "decode-0"


def test_bind_conflict_and_stop_are_clean(server: SideChannelServer) -> None:
    other = SideChannelServer({(0, 0): PAYLOAD}, host=LOOPBACK, port=server.port)
    with pytest.raises(SideChannelError, match=f"cannot bind tcp://{LOOPBACK}:{server.port}"):
        other.start()
    other.stop()  # never started: harmless
    server.stop()
    server.stop()  # idempotent
    assert not server.running
    with pytest.raises(HandshakeTimeoutError):
        fetch_metadata(LOOPBACK, server.port, timeout_s=DEADLINE)


def test_server_threads_do_not_leak() -> None:
    before = threading.active_count()
    for _ in range(5):
        with SideChannelServer({(0, 0): PAYLOAD}, host=LOOPBACK, port=0) as srv:
            fetch_metadata(LOOPBACK, srv.port, timeout_s=5)
    assert threading.active_count() == before
