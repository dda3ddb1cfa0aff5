"""Run in the vLLM venv: vLLM 0.30.0's side-channel listener and kvbridge's prefill listener
side by side on the same encoded payloads; prints what each answered as one JSON line.

Shows that a ``GET_META_MSG`` request gets the same payload bytes (and a msgpack float
timestamp) from both, that kvbridge's also answers the identity request and survives
garbage, and why a decode sends that request only to a kvbridge peer: vLLM's listener
thread dies on it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.utils.network_utils import get_open_port, make_zmq_path

from kvbridge_agent.identity import (
    ModelIdentity,
    decode_identity,
    encode_identity,
    encode_identity_request,
)
from kvbridge_agent.vllm._listener import serve_side_channel

IDENTITY = ModelIdentity("m", "r", "sampled-v1:" + "c" * 64)


def kvbridge_listener(data: Any, ready: threading.Event, stop: threading.Event, host: str,
                      port: int) -> None:  # fmt: skip
    with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
        serve_side_channel(sock, data, encode_identity(IDENTITY), ready, stop)


def ask(port: int, message: bytes) -> list[bytes] | None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(message)
        return sock.recv_multipart()
    except zmq.Again:
        return None
    finally:
        sock.close(0)


def main() -> None:
    encoder = msgspec.msgpack.Encoder()
    data = {(0, r): encoder.encode(NixlHandshakePayload(
        compatibility_hash=f"hash{r}", agent_metadata_bytes=bytes(range(256)) * (r + 1)))
        for r in range(2)}
    started = {}
    for name, target in (("vllm", NixlBaseConnectorScheduler._nixl_handshake_listener),
                         ("kvbridge", kvbridge_listener)):
        port, ready, stop = get_open_port(), threading.Event(), threading.Event()
        thread = threading.Thread(target=target, args=(data, ready, stop, "127.0.0.1", port),
                                  daemon=True)
        thread.start()
        ready.wait(10)
        started[name] = (port, thread)
    out: dict[str, Any] = {"same_payload": [], "float_timestamps": []}
    for rank in range(2):
        request = msgspec.msgpack.encode((GET_META_MSG, 0, rank))
        a, b = (ask(started[n][0], request) for n in ("vllm", "kvbridge"))
        assert a is not None and b is not None
        out["same_payload"].append(a[0] == b[0] == data[(0, rank)])
        out["float_timestamps"].append(all(
            isinstance(msgspec.msgpack.decode(r[1]), float) and len(r[1]) == 9 for r in (a, b)))
    reply = ask(started["kvbridge"][0], encode_identity_request())
    out["identity"] = reply is not None and decode_identity(reply[0]) == IDENTITY
    out["kvbridge_answers_garbage"] = ask(started["kvbridge"][0], b"\xc1") is not None
    out["kvbridge_alive"] = started["kvbridge"][1].is_alive()
    out["vllm_answers_identity_request"] = ask(started["vllm"][0],
                                               encode_identity_request()) is not None
    time.sleep(0.5)
    out["vllm_alive_after_identity_request"] = started["vllm"][1].is_alive()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
