"""The side-channel listener of a kvbridge prefill's scheduler (vLLM's, plus one request).

vLLM 0.30.0's ``_nixl_handshake_listener`` answers ``(GET_META_MSG, pp_rank, tp_rank)`` with
the rank's encoded ``NixlHandshakePayload`` and a msgpack ``perf_counter``. This loop gives
such a request exactly that reply, and also answers kvbridge's identity request
(:mod:`kvbridge_agent.identity._exchange`) with the identity and the same timestamp. Unlike
vLLM's loop, nothing a peer sends ends it: a request it cannot use is logged (at most once a
minute per kind) and answered with an error frame where a reply can be addressed.

Imports no vLLM (the scheduler passes the socket), so it is tested where vLLM is absent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq

from ..identity import is_identity_request
from ..protocol import GET_META_MSG
from ..sidechannel._common import encode_error

__all__ = ["serve_side_channel"]

log = logging.getLogger("kvbridge.vllm")

_LOG_EVERY_S = 60.0


class _Throttle:
    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last[kind] = now
            log.warning(msg, *args)


def answer(message: bytes, encoded_data: Mapping[tuple[int, int], bytes],
           identity_frame: bytes, warn: Callable[..., None] | None = None
           ) -> bytes:  # fmt: skip
    """The first reply frame for one request frame (an error frame if it is unusable);
    ``warn(kind, msg, *args)`` logs what was wrong with it."""
    warn = warn or _Throttle().warn
    try:
        request = msgspec.msgpack.decode(message)
    except msgspec.DecodeError as exc:
        warn("undecodable", "side channel: ignoring an undecodable request (%s)", exc)
        return encode_error("malformed", f"undecodable request: {exc}")
    if is_identity_request(request):
        return identity_frame
    if not isinstance(request, (list, tuple)) or len(request) != 3:
        warn("shape", "side channel: ignoring a request of unknown form %.200r", request)
        return encode_error("malformed", "expected (get_meta_msg, pp_rank, tp_rank)")
    msg, pp_rank, tp_rank = request
    if msg != GET_META_MSG:   # vLLM logs this and answers all the same
        warn("message", "Connection listener got unexpected message %.64r", msg)
    try:
        return encoded_data[(pp_rank, tp_rank)]
    except (KeyError, TypeError):
        warn("rank", "side channel: no rank (pp %.16r, tp %.16r) here", pp_rank, tp_rank)
        return encode_error("unknown_rank", f"no (pp_rank, tp_rank) = ({pp_rank!r:.16}, "
                            f"{tp_rank!r:.16}) on this engine")


def serve_side_channel(sock: zmq.Socket, encoded_data: Mapping[tuple[int, int], bytes],
                       identity_frame: bytes, ready_event: threading.Event,
                       stop_event: threading.Event) -> None:  # fmt: skip
    """Serve on a bound ROUTER ``sock`` until ``stop_event`` is set (checked at least once
    a second, as vLLM's loop does)."""
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    throttle = _Throttle()
    ready_event.set()
    while True:
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            if stop_event.is_set():
                break
            continue
        except zmq.ZMQError as exc:   # a closed context: vLLM is shutting down
            log.info("side channel: listener stops (%s)", exc)
            break
        if len(frames) != 3 or frames[1] != b"":
            throttle.warn("frames", "side channel: ignoring a message of %d frames (a REQ "
                          "client sends identity, empty, request)", len(frames))
            continue
        first = answer(frames[2], encoded_data, identity_frame, throttle.warn)
        # Echo our perf_counter (vLLM: the decode estimates the clock offset from it).
        ts = msgspec.msgpack.encode(time.perf_counter())
        try:
            sock.send_multipart((frames[0], b"", first, ts))
        except zmq.ZMQError as exc:
            throttle.warn("send", "side channel: reply not sent (%s)", exc)
