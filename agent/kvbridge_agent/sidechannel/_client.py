"""Side-channel client: REQ requests for one or more remote ranks, with one deadline.

Blocking, single-threaded (one client per thread, like vLLM's one-thread handshake pool). A
:class:`SideChannelClient` keeps one REQ socket per remote endpoint and reuses it for the
ranks of one handshake and for later ones; after a timeout or any transport error the socket
is closed and forgotten, because a REQ socket whose request went unanswered cannot send again
(ZMQ's REQ state machine). A socket monitor tells "never connected" (closed port, no route)
from "connected, no reply" in the timeout message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..protocol import (
    NixlAgentMetadata,
    NixlHandshakePayload,
    PayloadDecodeError,
    decode_handshake,
    decode_timestamp,
    encode_request,
)
from ._common import (
    DEFAULT_TIMEOUT_S,
    MAX_REPLY_BYTES,
    HandshakeTimeoutError,
    RemoteRejectedError,
    ReplyFormatError,
    SideChannelError,
    decode_error,
    tcp_endpoint,
)

Rank = tuple[int, int]


@dataclass(frozen=True)
class RankReply:
    """One remote rank's decoded reply and its timing (local and remote ``perf_counter``)."""

    pp_rank: int
    tp_rank: int
    payload: NixlHandshakePayload
    metadata: NixlAgentMetadata
    t_send: float
    t_recv: float
    remote_time: float

    @property
    def rtt(self) -> float:
        return self.t_recv - self.t_send

    @property
    def clock_offset(self) -> float:
        """``remote_perf - (t_send + t_recv) / 2`` (spec §1.1)."""
        return self.remote_time - (self.t_send + self.t_recv) / 2


@dataclass(frozen=True)
class HandshakeResult:
    """Replies in request order; ``best`` is the lowest-RTT sample (its offset is kept)."""

    endpoint: str
    replies: tuple[RankReply, ...]

    @property
    def best(self) -> RankReply:
        return min(self.replies, key=lambda r: r.rtt)

    @property
    def clock_offset(self) -> float:
        return self.best.clock_offset

    def metadata(self, pp_rank: int = 0, tp_rank: int = 0) -> NixlAgentMetadata:
        for r in self.replies:
            if (r.pp_rank, r.tp_rank) == (pp_rank, tp_rank):
                return r.metadata
        raise KeyError((pp_rank, tp_rank))


class _Conn:
    def __init__(self, ctx: zmq.Context, endpoint: str, max_reply_bytes: int) -> None:
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        if endpoint.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
        )
        self.connected = False
        self.retries = 0
        self.sock.connect(endpoint)

    def drain_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.retries += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class SideChannelClient:
    """Fetches handshake payloads over REQ sockets; see :meth:`fetch`. Not thread-safe."""

    def __init__(
        self, *, context: zmq.Context | None = None, max_reply_bytes: int = MAX_REPLY_BYTES
    ) -> None:
        # The process-wide context by default: creating one per handshake costs its I/O thread.
        self._ctx = context or zmq.Context.instance()
        self._max_reply_bytes = max_reply_bytes
        self._conns: dict[str, _Conn] = {}

    def fetch(
        self,
        host: str,
        port: int,
        targets: Iterable[Rank] = ((0, 0),),
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        local_hash: str | None = None,
        enforce_handshake_compat: bool = True,
        expected_engine_id: str | None = None,
    ) -> HandshakeResult:
        """Query each ``(pp_rank, tp_rank)`` in turn; all within ``timeout_s`` seconds.

        Each reply is decoded in two phases (:func:`decode_handshake`: payload, hash check
        against ``local_hash`` if given, metadata, engine id). Raises
        :class:`HandshakeTimeoutError` at the deadline, :class:`RemoteRejectedError` when the
        server answers with an error, :class:`ReplyFormatError` for a reply that is not two
        frames, and the :class:`~kvbridge_agent.protocol.ProtocolError` family for bad content.
        """
        endpoint = tcp_endpoint(host, port)
        deadline = time.monotonic() + timeout_s
        replies = []
        for pp_rank, tp_rank in targets:
            frames, t_send, t_recv = self._round_trip(
                endpoint, encode_request(pp_rank, tp_rank), deadline, timeout_s,
                f"(pp_rank, tp_rank) = ({pp_rank}, {tp_rank})",
            )
            if len(frames) != 2:
                self._discard(endpoint)
                raise ReplyFormatError(
                    f"side channel {endpoint}: expected 2 reply frames (payload, timestamp) for "
                    f"(pp_rank, tp_rank) = ({pp_rank}, {tp_rank}), got {len(frames)}"
                )
            try:
                payload, meta = decode_handshake(
                    frames[0],
                    local_hash=local_hash,
                    enforce_handshake_compat=enforce_handshake_compat,
                    expected_engine_id=expected_engine_id,
                )
            except PayloadDecodeError:
                err = decode_error(frames[0])
                if err is not None:
                    raise RemoteRejectedError(err.error, err.message, endpoint=endpoint) from None
                raise
            remote_time = decode_timestamp(frames[1])
            replies.append(RankReply(pp_rank, tp_rank, payload, meta, t_send, t_recv, remote_time))
        if not replies:
            raise SideChannelError("fetch: targets is empty; give at least one (pp, tp) rank")
        return HandshakeResult(endpoint, tuple(replies))

    def exchange(
        self, host: str, port: int, request: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S,
        what: str = "a kvbridge request",
    ) -> list[bytes]:
        """Send one request frame other than a handshake's and return the reply's frames.
        Only for a peer known to run kvbridge: vLLM's listener dies on such a request."""
        endpoint = tcp_endpoint(host, port)
        deadline = time.monotonic() + timeout_s
        return self._round_trip(endpoint, request, deadline, timeout_s, what)[0]

    def _round_trip(
        self, endpoint: str, request: bytes, deadline: float, timeout_s: float, what: str
    ) -> tuple[list[bytes], float, float]:
        conn = self._conns.get(endpoint)
        if conn is None:
            try:
                conn = self._conns[endpoint] = _Conn(self._ctx, endpoint, self._max_reply_bytes)
            except zmq.ZMQError as exc:
                raise SideChannelError(f"side channel {endpoint}: cannot connect: {exc}") from exc
        poller = zmq.Poller()
        poller.register(conn.sock, zmq.POLLIN)
        poller.register(conn.monitor, zmq.POLLIN)
        try:
            t_send = time.perf_counter()
            conn.sock.send(request)
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                events = dict(poller.poll(left_ms))
                if conn.monitor in events:
                    conn.drain_monitor()
                if conn.sock in events:
                    frames = conn.sock.recv_multipart()
                    return frames, t_send, time.perf_counter()
        except zmq.ZMQError as exc:
            self._discard(endpoint)
            raise SideChannelError(f"side channel {endpoint}: {exc}") from exc
        conn.drain_monitor()
        connected, retries = conn.connected, conn.retries
        self._discard(endpoint)
        if connected:
            why = "connected, but the server did not answer"
        else:
            why = (
                f"never connected ({retries} connection attempt(s) failed: nothing listening "
                "there, or unreachable)"
            )
        raise HandshakeTimeoutError(
            f"side channel {endpoint}: no reply for {what} "
            f"within the {timeout_s:g} s deadline: {why}",
            endpoint=endpoint,
            connected=connected,
        )

    def _discard(self, endpoint: str) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this client's sockets (the context stays open: it is shared). Idempotent."""
        for endpoint in list(self._conns):
            self._discard(endpoint)

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_metadata(
    host: str,
    port: int,
    targets: Iterable[Rank] = ((0, 0),),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_hash: str | None = None,
    enforce_handshake_compat: bool = True,
    expected_engine_id: str | None = None,
) -> HandshakeResult:
    """One-shot :meth:`SideChannelClient.fetch` on a fresh client (closed on return)."""
    with SideChannelClient() as client:
        return client.fetch(
            host,
            port,
            targets,
            timeout_s=timeout_s,
            local_hash=local_hash,
            enforce_handshake_compat=enforce_handshake_compat,
            expected_engine_id=expected_engine_id,
        )
