"""Fuzzing the side channel: >= 10,000 malformed requests against a running server, malformed
payloads against the decoders and the client. Seeded, so a failure reproduces."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvbridge_agent.protocol import (
    ProtocolError,
    decode_handshake,
    decode_metadata,
    decode_payload,
    decode_request,
    decode_timestamp,
    encode_request,
)
from kvbridge_agent.sidechannel import (
    ErrorReply,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    fetch_metadata,
)
from spec_vectors import load_vectors

VECTORS = load_vectors("v11-handshake.json")
PAYLOAD = bytes.fromhex(VECTORS["examples"][0]["payload_msgpack_hex"])
SERVED = {(0, 0), (0, 1)}
LOOPBACK = "127.0.0.1"
N_REQUESTS = 12_000
BATCH = 400


def random_msgpack_obj(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if choice == 1:
        return rng.random() * 1e6
    if choice == 2:
        return rng.randbytes(rng.randrange(20))
    if choice == 3:
        return "".join(rng.choice("get_meta_msgé\x00") for _ in range(rng.randrange(14)))
    if choice == 4:
        return None
    if choice == 5:
        return rng.random() < 0.5
    if choice == 6:
        return [random_msgpack_obj(rng, depth + 1) for _ in range(rng.randrange(5))]
    if choice == 7:
        return {
            str(rng.randrange(9)): random_msgpack_obj(rng, depth + 1)
            for _ in range(rng.randrange(4))
        }
    return [b"get_meta_msg", random_msgpack_obj(rng, depth + 1), random_msgpack_obj(rng, depth + 1)]


def mutate(rng: random.Random, buf: bytes) -> bytes:
    data = bytearray(buf)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :]
        elif op == 2:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        elif data:
            data[rng.randrange(len(data))] = rng.choice((0xC1, 0xDD, 0xDF, 0xC6, 0xFF, 0x00))
    return bytes(data)


def malformed_request(rng: random.Random) -> list[bytes]:
    """Body frames of one bad request (the empty delimiter is added by the sender)."""
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.randrange(64))]
    if kind == 1:
        return [msgspec.msgpack.encode(random_msgpack_obj(rng))]
    if kind == 2:
        return [mutate(rng, encode_request(0, 1))]
    if kind == 3:  # unknown ranks, including out-of-range integers
        pp = rng.choice([-1, 1, 2**31, 2**63 - 1, -(2**63)])
        return [encode_request(pp, rng.randrange(-3, 1000))]
    if kind == 4:  # wrong number of frames
        n = rng.choice([0, 2, 3, 7])
        return [encode_request(0, 0) if rng.random() < 0.5 else b"x" for _ in range(n)]
    return [b""]


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    with SideChannelServer({r: PAYLOAD for r in SERVED}, host=LOOPBACK, port=0) as srv:
        yield srv


def test_server_survives_malformed_requests(
    server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(20260911)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.endpoint)
    sent = ok = rejected = 0
    kinds: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="kvbridge_agent.sidechannel"):
        while sent < N_REQUESTS:
            batch = [malformed_request(rng) for _ in range(BATCH)]
            for body in batch:
                dealer.send_multipart([b"", *body])
            sent += len(batch)
            for _ in batch:  # every request is answered: error reply, or a lucky valid one
                assert dealer.poll(10_000), f"server stopped answering after {sent} requests"
                frames = dealer.recv_multipart()
                assert len(frames) == 3 and frames[0] == b""
                assert decode_timestamp(frames[2]) > 0
                if frames[1] == PAYLOAD:
                    ok += 1
                    continue
                err = msgspec.msgpack.decode(frames[1], type=ErrorReply)
                kinds.add(err.error)
                rejected += 1
        # Oversized frames: ZMQ_MAXMSGSIZE drops such a peer without a reply.
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(server.endpoint)
        for _ in range(3):
            big.send_multipart([b"", b"\x93" + rng.randbytes(1 << 20)])
        assert not big.poll(300)
        big.close(0)
    dealer.close(0)
    assert sent >= 10_000 and ok + rejected == sent
    assert kinds == {"malformed", "unknown_rank", "frame_count"}
    stats = server.stats()
    assert "internal" not in stats
    assert sum(stats.values()) == sent and stats.get("ok", 0) == ok
    # Rate-limited logging: one warning per kind, not one per message.
    records = [r for r in caplog.records if r.name.startswith("kvbridge_agent.sidechannel")]
    assert len(records) <= len(kinds)
    # And it still serves a well-formed request.
    assert server.running
    result = fetch_metadata(LOOPBACK, server.port, [(0, 1)], timeout_s=5)
    assert result.metadata(0, 1).engine_id == "decode-0"


def test_decoders_raise_only_protocol_errors() -> None:
    rng = random.Random(7)
    meta_bytes = bytes.fromhex(VECTORS["examples"][0]["metadata_msgpack_hex"])
    seeds = [PAYLOAD, meta_bytes, encode_request(0, 1), msgspec.msgpack.encode(1.5)]
    decoders = (
        decode_payload,
        decode_metadata,
        decode_request,
        decode_timestamp,
        lambda b: decode_handshake(b, local_hash="0" * 64),
    )
    counts = {"ok": 0, "error": 0}
    for i in range(12_000):
        buf = mutate(rng, rng.choice(seeds)) if i % 3 else rng.randbytes(rng.randrange(200))
        for decode in decoders:
            try:
                decode(buf)
                counts["ok"] += 1
            except ProtocolError as exc:
                assert str(exc)
                counts["error"] += 1
    assert counts["error"] > 0


def test_client_survives_malformed_replies() -> None:
    """A hostile server: every reply is garbage; the client raises typed errors, never hangs."""
    rng = random.Random(99)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{LOOPBACK}")
    stop = threading.Event()

    def hostile() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, delim, _ = router.recv_multipart()
            n = rng.choice([1, 2, 2, 2, 3])
            frames = [
                mutate(rng, PAYLOAD) if rng.random() < 0.7 else rng.randbytes(20) for _ in range(n)
            ]
            router.send_multipart([ident, delim, *frames])
        router.close(0)

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    errors: dict[str, int] = {}
    try:
        with SideChannelClient() as client:
            for _ in range(500):
                try:
                    client.fetch(LOOPBACK, port, timeout_s=5)
                except (ProtocolError, SideChannelError) as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    finally:
        stop.set()
        thread.join(5)
    assert "HandshakeTimeoutError" not in errors
    assert {"ReplyFormatError", "PayloadDecodeError"} <= set(errors)
