"""Side-channel server: a ZMQ ROUTER answering ``get_meta_msg`` requests (spec §1.1).

Threading: :meth:`SideChannelServer.start` binds the socket in the caller's thread (so bind
errors raise there and the port is known on return), then hands the socket to one daemon
thread, which alone uses it until it closes it on exit. The thread polls with
``poll_interval_s`` so :meth:`stop` (an Event) takes effect within one interval; ``stop``
joins the thread and terminates the private ZMQ context. Replies are precomputed payload bytes
plus a fresh ``time.perf_counter()`` frame, sent NOBLOCK: a peer that vanished or stopped
reading is dropped by ROUTER, never waited on.

Robustness: nothing a peer sends stops the loop. A malformed request, a wrong frame count or an
unknown rank gets an error reply (:class:`ErrorReply`); frames above ``max_request_bytes`` make
ZMQ drop the peer (``ZMQ_MAXMSGSIZE``). Each kind of bad input is counted in :meth:`stats` and
logged at most once per ``log_interval_s`` with the number suppressed in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

import zmq

from ..protocol import (
    NixlHandshakePayload,
    RequestDecodeError,
    decode_request,
    encode_payload,
    encode_timestamp,
)
from ._common import (
    MAX_REQUEST_BYTES,
    SideChannelError,
    encode_error,
    side_channel_address,
    tcp_endpoint,
)

_log = logging.getLogger(__name__)

Rank = tuple[int, int]


class _RateLimitedLog:
    """At most one warning per kind per interval, carrying the count suppressed meanwhile."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def warn(self, kind: str, detail: str, *, exc_info: bool = False) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] += 1
            return
        self._last[kind] = now
        extra = self._suppressed.pop(kind, 0)
        _log.warning(
            "side channel: %s (%d similar suppressed): %s", kind, extra, detail, exc_info=exc_info
        )


class SideChannelServer:
    """Serves one engine's handshake payloads, keyed by ``(pp_rank, tp_rank)``.

    ``payloads`` values are encoded payload bytes or :class:`NixlHandshakePayload` (encoded
    once here). ``host``/``port`` default to the vLLM environment variables (spec §1.1) with
    ``dp_index`` added to the port; ``port=0`` binds an ephemeral port (see :attr:`port`).
    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        payloads: Mapping[Rank, bytes | NixlHandshakePayload],
        *,
        host: str | None = None,
        port: int | None = None,
        dp_index: int = 0,
        poll_interval_s: float = 0.1,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        log_interval_s: float = 60.0,
    ) -> None:
        if not payloads:
            raise SideChannelError("payloads: expected at least one (pp_rank, tp_rank) entry")
        self._payloads: dict[Rank, bytes] = {
            (int(pp), int(tp)): p if isinstance(p, bytes) else encode_payload(p)
            for (pp, tp), p in payloads.items()
        }
        self._host, self._port = side_channel_address(dp_index, host=host, port=port)
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._max_request_bytes = max_request_bytes
        self._log = _RateLimitedLog(log_interval_s)
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._endpoint = ""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> SideChannelServer:
        """Bind and start serving; raises :class:`SideChannelError` if the bind fails."""
        if self._thread is not None:
            raise SideChannelError("side-channel server: already started")
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_request_bytes)
        if ":" in self._host:
            sock.setsockopt(zmq.IPV6, 1)
        want = tcp_endpoint(self._host, self._port or "*")
        try:
            sock.bind(want)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            raise SideChannelError(f"side-channel server: cannot bind {want}: {exc}") from exc
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(self._endpoint.rsplit(":", 1)[1])
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="kvbridge-side-channel", daemon=True
        )
        self._thread.start()
        _log.info("side channel serving %d rank(s) on %s", len(self._payloads), self._endpoint)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, close the socket and the context. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.error("side-channel thread did not stop within %.1f s", timeout_s)
                return
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    close = stop

    def __enter__(self) -> SideChannelServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- introspection ---------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """Bound port (the real one after :meth:`start` when 0 was asked)."""
        return self._port

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` actually bound ("" before :meth:`start`)."""
        return self._endpoint

    @property
    def ranks(self) -> tuple[Rank, ...]:
        return tuple(sorted(self._payloads))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """Counts per outcome: ``ok``, ``malformed``, ``frame_count``, ``unknown_rank``, ..."""
        with self._stats_lock:
            return dict(self._stats)

    # -- serving thread --------------------------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(self._poll_ms, zmq.POLLIN):
                    continue
                for _ in range(256):  # drain a burst, then re-check the stop event
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(sock, frames)
                    except Exception as exc:  # keep serving whatever happens
                        self._count("internal")
                        self._log.warn("internal", repr(exc), exc_info=True)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                _log.error("side-channel server stopped on a ZMQ error: %s", exc)
        finally:
            sock.close(0)

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # ROUTER prepends the peer identity; REQ (and polite DEALERs) add an empty delimiter.
        split = 2 if len(frames) >= 2 and frames[1] == b"" else 1
        envelope, body = frames[:split], frames[split:]
        if len(body) != 1:
            self._reject(
                sock, envelope, "frame_count", f"expected 1 request frame, got {len(body)}"
            )
            return
        try:
            rank = decode_request(body[0])
        except RequestDecodeError as exc:
            self._reject(sock, envelope, "malformed", str(exc))
            return
        payload = self._payloads.get(rank)
        if payload is None:
            self._reject(
                sock,
                envelope,
                "unknown_rank",
                f"(pp_rank, tp_rank) = {rank} is not served here; served: {list(self.ranks)}",
            )
            return
        self._count("ok")  # before sending: a peer that got its reply sees it counted
        self._send(sock, envelope, payload)

    def _reject(self, sock: zmq.Socket, envelope: list[bytes], kind: str, detail: str) -> None:
        self._count(kind)
        self._log.warn(kind, detail)
        self._send(sock, envelope, encode_error(kind, detail))

    def _send(self, sock: zmq.Socket, envelope: list[bytes], first: bytes) -> None:
        try:
            sock.send_multipart(
                [*envelope, first, encode_timestamp(time.perf_counter())], zmq.NOBLOCK
            )
        except zmq.Again:  # peer's queue is full: drop, as ROUTER does for a vanished peer
            self._count("dropped")

    def _count(self, kind: str) -> None:
        with self._stats_lock:
            self._stats[kind] += 1
