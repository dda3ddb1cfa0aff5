"""The vLLM NIXL side channel (spec §1.1): a ZMQ ROUTER server and a REQ client.

- :class:`SideChannelServer` serves precomputed handshake payloads per ``(pp_rank, tp_rank)``
  from a daemon thread, on ``$VLLM_NIXL_SIDE_CHANNEL_HOST:$VLLM_NIXL_SIDE_CHANNEL_PORT +
  dp_index`` by default, and survives any input.
- :class:`SideChannelClient` / :func:`fetch_metadata` query a list of ranks within one deadline
  and keep the lowest-RTT clock offset.

Errors: :class:`SideChannelError` (a ``RuntimeError``) for transport problems, and the
``kvbridge_agent.protocol.ProtocolError`` family for bad content.

spec §N: sections of docs/protocol.md.
"""

from ._client import HandshakeResult, RankReply, SideChannelClient, fetch_metadata
from ._common import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    HOST_ENV,
    PORT_ENV,
    ErrorReply,
    HandshakeTimeoutError,
    RemoteRejectedError,
    ReplyFormatError,
    SideChannelError,
    side_channel_address,
    tcp_endpoint,
)
from ._server import SideChannelServer

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "HOST_ENV",
    "PORT_ENV",
    "ErrorReply",
    "HandshakeResult",
    "HandshakeTimeoutError",
    "RankReply",
    "RemoteRejectedError",
    "ReplyFormatError",
    "SideChannelClient",
    "SideChannelError",
    "SideChannelServer",
    "fetch_metadata",
    "side_channel_address",
    "tcp_endpoint",
]
