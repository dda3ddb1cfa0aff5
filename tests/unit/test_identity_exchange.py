"""The model identity kvbridge engines exchange on the side channel (issue #35): the
comparison, the wire forms, the prefill's listener (driven over real ZMQ sockets: vLLM's
request gets vLLM's reply, the identity request the identity, and no input stops it) and
the decode's per-peer verdicts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvbridge_agent import metrics
from kvbridge_agent.identity import (
    EXCHANGE_VERSION,
    MARKER_KEY,
    ModelIdentity,
    compare_identities,
    decode_identity,
    encode_identity,
    encode_identity_request,
    is_identity_request,
)
from kvbridge_agent.protocol import GET_META_MSG, encode_request
from kvbridge_agent.sidechannel import SideChannelClient, SideChannelError
from kvbridge_agent.vllm._listener import answer, serve_side_channel
from kvbridge_agent.vllm._peer_models import PeerModels, fetch_identity

A = ModelIdentity("m", "", "sampled-v1:" + "a" * 64, "0.30.0", "0.1.0")
B = ModelIdentity("m", "", "sampled-v1:" + "b" * 64, "0.30.0", "0.1.0")
PAYLOADS = {(0, 0): b"\x82payload-rank-0", (0, 1): b"\x82payload-rank-1"}


# -- pure logic ------------------------------------------------------------------------------
@pytest.mark.parametrize(("local", "remote", "status"), [
    (A, A, "match"),
    (A, B, "mismatch"),
    (A, ModelIdentity("other-name", fingerprint=A.fingerprint), "match"),
    (A, ModelIdentity("m", fingerprint="full-v1:" + "a" * 64), "mismatch"),
    (A, ModelIdentity("m"), "unchecked"),
    (ModelIdentity("m"), A, "unchecked"),
    (ModelIdentity("m", "r1"), ModelIdentity("m", "r2"), "mismatch"),
    (ModelIdentity("m", "r1"), ModelIdentity("m", "r1"), "unchecked"),
    (ModelIdentity("m", "r1", A.fingerprint), ModelIdentity("m", "r2", A.fingerprint), "match"),
])
def test_compare(local: ModelIdentity, remote: ModelIdentity, status: str) -> None:
    verdict = compare_identities(local, remote)
    assert verdict.status == status
    assert verdict.declines == (status == "mismatch")


def test_wire_forms() -> None:
    assert msgspec.msgpack.decode(encode_identity_request()) == ["kvbridge_identity", 1]
    assert is_identity_request(["kvbridge_identity", 2])
    for other in ([GET_META_MSG, 0, 0], ["kvbridge_identity"], [b"kvbridge_identity", 1],
                  ["kvbridge_identity", "1"], {"kvbridge_identity": 1}, 7):
        assert not is_identity_request(other)
    # vLLM's form is three items, the first bytes: the identity request is never one.
    assert len(msgspec.msgpack.decode(encode_request(0, 0))) == 3
    assert decode_identity(encode_identity(A)) == A
    body = msgspec.msgpack.decode(encode_identity(A))
    assert body["v"] == EXCHANGE_VERSION and body["fingerprint"] == A.fingerprint
    later = msgspec.msgpack.encode({**body, "v": 2, "extra": [1, 2]})
    assert decode_identity(later) == A, "a later version's extra keys are ignored"
    for bad in (b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"v": 1,
                "fingerprint": 5}), msgspec.msgpack.encode({"name": "m"})):
        with pytest.raises(ValueError):
            decode_identity(bad)
    assert MARKER_KEY == "kvbridge_identity"


def test_answer_without_sockets() -> None:
    frame = encode_identity(A)
    assert answer(encode_request(0, 1), PAYLOADS, frame) == PAYLOADS[(0, 1)]
    assert answer(encode_identity_request(), PAYLOADS, frame) == frame
    # vLLM only logs a wrong first item and answers all the same: so does this listener.
    assert answer(msgspec.msgpack.encode([b"other", 0, 0]), PAYLOADS, frame) == PAYLOADS[(0, 0)]
    for junk in (b"\xc1", msgspec.msgpack.encode([1, 2, 3, 4]),
                 encode_request(0, 9), msgspec.msgpack.encode([GET_META_MSG, [0], 0])):
        assert msgspec.msgpack.decode(answer(junk, PAYLOADS, frame)).keys() == {
            "error", "message"}


# -- the listener over real sockets ---------------------------------------------------------
@pytest.fixture
def listener() -> Iterator[tuple[str, threading.Thread]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve_side_channel, daemon=True,
                              args=(sock, PAYLOADS, encode_identity(A), ready, stop))
    thread.start()
    assert ready.wait(5)
    try:
        yield f"tcp://127.0.0.1:{port}", thread
    finally:
        stop.set()
        thread.join(5)
        sock.close(0)
        ctx.term()


def _req(endpoint: str, *frames: bytes) -> list[bytes]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    try:
        sock.send_multipart(list(frames))
        return sock.recv_multipart()
    finally:
        sock.close(0)


def _send_raw(endpoint: str, *frames: bytes) -> None:
    """A DEALER (no REQ envelope): frames a REQ client never sends."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send_multipart(list(frames))
    sock.close()


def test_listener_replies_as_vllm_does(listener: tuple[str, threading.Thread]) -> None:
    endpoint, _ = listener
    for rank in ((0, 0), (0, 1)):
        # What vLLM's decode sends: msgspec's encoding of (GET_META_MSG, pp, tp).
        frames = _req(endpoint, msgspec.msgpack.encode((GET_META_MSG, *rank)))
        assert len(frames) == 2 and frames[0] == PAYLOADS[rank]
        ts = msgspec.msgpack.decode(frames[1])
        assert isinstance(ts, float)
        assert frames[1] == msgspec.msgpack.encode(ts), "a msgpack float64, as vLLM's"
    frames = _req(endpoint, encode_identity_request())
    assert decode_identity(frames[0]) == A
    assert isinstance(msgspec.msgpack.decode(frames[1]), float)


def test_listener_survives_garbage(listener: tuple[str, threading.Thread]) -> None:
    endpoint, thread = listener
    for junk in (b"", b"\xc1\xc1", b"\x93", msgspec.msgpack.encode(["kvbridge_identity"]),
                 msgspec.msgpack.encode([GET_META_MSG, 0, 5]), b"x" * 10_000):
        frames = _req(endpoint, junk)
        assert "error" in msgspec.msgpack.decode(frames[0])
    _send_raw(endpoint, b"no-envelope")
    _send_raw(endpoint, b"", b"a", b"b", b"c")
    assert thread.is_alive()
    assert _req(endpoint, encode_request(0, 0))[0] == PAYLOADS[(0, 0)]
    assert fetch_identity("p", "127.0.0.1", int(endpoint.rsplit(":", 1)[1]), 3.0) == A


def test_client_exchange_times_out_on_a_silent_port() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with SideChannelClient() as client, pytest.raises(SideChannelError, match="identity"):
            client.exchange("127.0.0.1", port, encode_identity_request(), timeout_s=0.3,
                            what="the identity")
    finally:
        silent.close(0)


# -- the decode's verdicts -------------------------------------------------------------------
class _Fetch:
    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self, engine_id: str, host: str, port: int, timeout_s: float
                 ) -> ModelIdentity:  # fmt: skip
        self.calls += 1
        got = self.answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got


def test_peer_models_decline_a_mismatch_once_checked(caplog: pytest.LogCaptureFixture) -> None:
    fetch = _Fetch(B)
    models = PeerModels(A, 1.0, fetch)
    assert models.settled("p"), "an engine not marked is never checked (stock peers)"
    models.mark("p")
    assert not models.settled("p")
    before = metrics.value("kvbridge_agent_reads_declined_total", cause="model_mismatch")
    with caplog.at_level("ERROR", logger="kvbridge.vllm"):
        assert models.check("p", "h", 1) == ""
    assert models.settled("p") and fetch.calls == 1
    assert A.fingerprint in caplog.text and B.fingerprint in caplog.text
    assert models.declines("p", "r1") and models.declines("p", "r2")
    assert metrics.value("kvbridge_agent_reads_declined_total",
                         cause="model_mismatch") == before + 2
    assert models.check("p", "h", 1) == "" and fetch.calls == 1, "the verdict is kept"
    assert not models.declines("q", "r3")


def test_peer_models_recheck_after_a_new_handshake() -> None:
    fetch = _Fetch(B, A, B)
    models = PeerModels(A, 1.0, fetch)
    models.mark("p")
    models.check("p", "h", 1, generation=10.0)
    assert models.declines("p", "r") and models.settled("p", 10.0)
    # Handshaken again (a restart, an epoch change): the verdict is of the old generation.
    assert not models.settled("p", 20.0)
    models.check("p", "h", 1, generation=20.0)
    assert models.settled("p", 20.0) and fetch.calls == 2
    assert not models.declines("p", "r") and models.verdict("p").status == "match"
    models.forget("p")
    assert not models.settled("p", 20.0)
    models.check("p", "h", 1, generation=20.0)
    assert models.declines("p", "r") and fetch.calls == 3


def test_peer_models_failures_and_no_fingerprint() -> None:
    fetch = _Fetch(SideChannelError("timed out"), ValueError("garbage"), ModelIdentity("m"))
    models = PeerModels(A, 1.0, fetch)
    models.mark("p")
    assert "timed out" in models.check("p", "h", 1)
    assert not models.settled("p"), "no verdict kept: the next request asks again"
    assert "garbage" in models.check("p", "h", 1)
    assert models.check("p", "h", 1) == ""
    assert models.verdict("p").status == "unchecked" and not models.declines("p", "r")
    off = PeerModels(ModelIdentity("m"), 1.0, _Fetch())
    off.mark("p")
    assert off.settled("p") and off.check("p", "h", 1) == "", "digest off: nothing asked"
