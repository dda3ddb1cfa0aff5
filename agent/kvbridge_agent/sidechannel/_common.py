"""Addresses, environment variables, errors and the error-reply frame of the side channel."""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from .. import env as names
from ..errors import KVBridgeError
from ..resources import HANDSHAKE_TIMEOUT_S

HOST_ENV, PORT_ENV = names.SIDE_CHANNEL_HOST, names.SIDE_CHANNEL_PORT
DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5600
DEFAULT_TIMEOUT_S = HANDSHAKE_TIMEOUT_S
"""vLLM's handshake receive timeout (spec §1.1)."""

MAX_REQUEST_BYTES = 64 * 1024
"""ZMQ_MAXMSGSIZE of the server: a request is 17 bytes; larger frames drop the peer."""
MAX_REPLY_BYTES = 256 * 1024 * 1024
"""ZMQ_MAXMSGSIZE of the client: metadata of a few hundred regions is well below this."""


class SideChannelError(KVBridgeError, RuntimeError):
    """Base of side-channel failures (transport, timeouts, rejected requests)."""


class HandshakeTimeoutError(SideChannelError, TimeoutError):
    """No reply before the deadline. ``connected`` tells a dead port from a silent server."""

    def __init__(self, message: str, *, endpoint: str, connected: bool) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.connected = connected


class RemoteRejectedError(SideChannelError):
    """The server answered with an error reply (unknown rank, malformed request)."""

    def __init__(self, kind: str, message: str, *, endpoint: str) -> None:
        super().__init__(f"side channel {endpoint} rejected the request ({kind}): {message}")
        self.kind = kind
        self.endpoint = endpoint


class ReplyFormatError(SideChannelError):
    """The reply did not have the two frames of spec §1.1."""


class ErrorReply(msgspec.Struct):
    """First frame of an error reply. A vLLM client fails to decode it as a payload (and
    reports a decode error at once) instead of waiting for its receive timeout."""

    error: str
    message: str


_ERROR_DECODER = msgspec.msgpack.Decoder(ErrorReply)


def encode_error(kind: str, message: str) -> bytes:
    return msgspec.msgpack.encode(ErrorReply(error=kind, message=message))


def decode_error(buf: bytes) -> ErrorReply | None:
    """The error reply in ``buf``, or None if ``buf`` is not one."""
    try:
        return _ERROR_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def side_channel_address(
    dp_index: int = 0,
    *,
    host: str | None = None,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, int]:
    """``(host, port + dp_index)`` as vLLM computes it (spec §1.1).

    ``host`` defaults to ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` or ``"localhost"``; the base ``port``
    to ``$VLLM_NIXL_SIDE_CHANNEL_PORT`` or 5600. A base port of 0 means "ephemeral" and is
    returned as 0 whatever the DP index.
    """
    env = os.environ if environ is None else environ
    host = host or env.get(HOST_ENV) or DEFAULT_HOST
    if port is None:
        raw = env.get(PORT_ENV)
        try:
            port = int(raw) if raw else DEFAULT_PORT
        except ValueError:
            raise SideChannelError(f"{PORT_ENV}: expected an integer port, got {raw!r}") from None
    if dp_index < 0:
        raise SideChannelError(f"dp_index: expected >= 0, got {dp_index}")
    if port == 0:
        return host, 0
    if not 0 < port + dp_index < 65536:
        raise SideChannelError(
            f"side-channel port: base {port} + dp_index {dp_index} is outside 1..65535"
        )
    return host, port + dp_index


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port``, bracketing IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
