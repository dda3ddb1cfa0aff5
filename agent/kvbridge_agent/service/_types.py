"""The agent service's value types: engine facts, settings, assigned peers, handshake
reports and transfer results (what callers and the KVEndpoint status exchange)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from .. import rules
from ..errors import KVBridgeError
from ..nixl._producer import DEFAULT_LEASE_S
from ..resources import (
    DECODE,
    HANDSHAKE_FIELDS,
    HANDSHAKE_TIMEOUT_S,
    PEER_FIELDS,
    PREFILL,
    TRANSFER_TIMEOUT_S,
    HandshakeState,
    document,
)

__all__ = [
    "DECODE",
    "PREFILL",
    "AgentClosedError",
    "AgentError",
    "AgentSettings",
    "EngineInfo",
    "HandshakeOutcome",
    "PeerRef",
    "PeerReport",
    "Side",
    "StalePeerError",
    "TransferResult",
    "UnknownRequestError",
    "WrongSideError",
]

def utc_timestamp() -> str:
    """Now, as the RFC 3339 UTC string Kubernetes status fields use."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class AgentError(KVBridgeError):
    """Base of the agent service's own errors (each also derives from the built-in error
    callers caught before these existed)."""


class WrongSideError(AgentError, RuntimeError):
    """A call this agent's side does not make (a pull on a prefill agent, for instance)."""


class AgentClosedError(AgentError, RuntimeError):
    """The agent was closed while the call was in flight."""


class UnknownRequestError(AgentError, KeyError):
    """A request id this agent was never told about."""

    def __str__(self) -> str:   # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class StalePeerError(AgentError, RuntimeError):
    """A handshake reached an agent of another epoch than the one assigned."""


class Side(StrEnum):
    """What an agent does with the bytes, chosen once from its role and mode.

    PULLER (decode, pull) READs from prefill ranks; PUSHER (prefill, push) WRITEs into
    decode ranks; RECEIVER (prefill in pull mode, decode in push mode) keeps its blocks for
    the other side and waits for its completion notifications. Movers load the peer's full
    memory description at a handshake, a receiver only its NIXL agent.
    """

    PULLER = "puller"
    PUSHER = "pusher"
    RECEIVER = "receiver"

    @classmethod
    def of(cls, role: str, mode: str) -> Side:
        if mode == "pull":
            return cls.PULLER if role == DECODE else cls.RECEIVER
        return cls.PUSHER if role == PREFILL else cls.RECEIVER

    @property
    def moves(self) -> bool:
        return self is not Side.RECEIVER


class HandshakeOutcome(StrEnum):
    """How one handshake ended (the ``result`` label of the handshake metric)."""

    SUCCEEDED = "succeeded"
    INCOMPATIBLE = "incompatible"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    STALE = "stale"
    ERROR = "error"


@dataclass(frozen=True)
class EngineInfo:
    """Engine facts the region plan does not carry (what vLLM knows at registration).

    ``num_blocks`` is the main pool's kernel block count (default: the largest region
    capacity); ``is_mla`` says regions are replicated latent caches (read whole).
    """

    engine_id: str
    role: str
    tp_rank: int = 0
    tp_size: int = 1
    dp_index: int = 0
    block_size: int = 16
    ppl: int = 1
    num_blocks: int | None = None
    kv_cache_layout: str = "HND"
    attn_backend_name: str = "FLASH_ATTN"
    is_mla: bool = False
    num_kv_heads: int | None = None
    mode: str = "pull"
    dcp_size: int = 1
    pcp_size: int = 1
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE):
            raise ValueError(f"EngineInfo.role: expected 'prefill' or 'decode', got {self.role!r}")
        if self.mode not in rules.MODES:
            raise ValueError(f"EngineInfo.mode: expected 'pull' or 'push', got {self.mode!r}")
        if bad := rules.tp_rank(self.tp_rank, self.tp_size, name="EngineInfo.{}".format):
            raise ValueError(bad.message)


@dataclass(frozen=True)
class AgentSettings:
    """Runtime settings.

    Attributes:
        side_channel_host: address the side channel binds (``"0.0.0.0"`` in a pod).
        side_channel_port: base port (``dp_index`` is added); 0 picks a free port.
        advertise_host: host published in the KVEndpoint (the pod IP); default: bind host.
        handshake_timeout_s: deadline of one side-channel handshake.
        transfer_timeout_s: default deadline of one transfer request.
        progress_interval_s: period of the progress thread.
        mem_types: a ``nixl.MemTypeMap`` (default: production DRAM/VRAM).
        epoch: this start's epoch (default: milliseconds since the Unix epoch).
        enforce_hash: refuse peers with another compatibility hash (vLLM default).
        serve_side_channel: serve the v11 payload on our own side channel. ``False`` when
            the host engine serves it (vLLM's scheduler does); ``side_channel_port`` is
            then the port that engine serves on, published as is (plus ``dp_index``).
        producer_too: in pull mode, a decode agent also holds blocks for remote readers
            and counts their completion notifications (vLLM's ``kv_both`` role).
        progress_thread: poll transfers and notifications on a thread of our own. ``False``
            when the host engine drives :meth:`AgentService.progress` every step (vLLM's
            model runner does): a second thread would only contend for the lock and the GIL
            on the engine's hot path.
        nixl_threads: UCX worker threads of the NIXL agent (0: NIXL's default). The vLLM
            connector passes vLLM's own ``num_threads`` (default 4), as vLLM's NIXL worker does.
        lease_s: a producer's default lease; a heartbeat extends a held request to
            ``now + lease_s * 2/3``. The vLLM connector passes ``kv_lease_duration``.
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str | None = None
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    progress_interval_s: float = 0.01
    mem_types: Any = None
    epoch: int | None = None
    enforce_hash: bool = True
    serve_side_channel: bool = True
    producer_too: bool = False
    progress_thread: bool = True
    nixl_threads: int = 0
    lease_s: float = DEFAULT_LEASE_S


@dataclass(frozen=True)
class PeerRef:
    """One assigned peer, as the operator writes it into ``status.peers``.

    ``epoch`` is ``None`` for a peer found on demand (a request's ``kv_transfer_params``),
    whose epoch nobody assigned: any NIXL agent answering on that side channel is taken.
    """

    name: str
    engine_id: str
    host: str
    port: int
    tp_rank: int
    tp_size: int
    epoch: int | None
    role: str = ""

    @classmethod
    def from_status(cls, item: Mapping[str, Any]) -> PeerRef:
        f = PEER_FIELDS
        return cls(
            name=str(f.name.at(item)), engine_id=str(f.engine_id.at(item)),
            host=str(f.host.get(item) or ""), port=int(f.port.get(item) or 0),
            tp_rank=int(item.get(f.tp_rank.key, 0)), tp_size=int(f.tp_size.get(item) or 1),
            epoch=int(item.get(f.epoch.key, 0)), role=str(f.role.get(item) or ""))

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.tp_rank)


#: ``status.handshakes[].message`` maxLength in the KVEndpoint CRD (a longer one is cut).
HANDSHAKE_MESSAGE_MAX = 1024
#: ``status.handshakes[].transport`` maxLength in the KVEndpoint CRD.
TRANSPORT_MAX = 128


@dataclass(frozen=True)
class PeerReport:
    """Result of one handshake; :meth:`to_status` is a ``status.handshakes`` item."""

    peer: str
    engine_id: str
    epoch: int | None
    ok: bool
    message: str = ""
    reason: HandshakeOutcome = HandshakeOutcome.ERROR
    time: str = ""
    agent_name: str = ""
    #: UCX transport(s) reaching the peer (``cma``, ``tcp``, ..., ``unknown``), and lanes
    transport: str = ""
    transport_detail: str = ""

    def to_status(self) -> dict[str, Any]:
        values: dict[str, Any] = {
            "peer": self.peer, "engine_id": self.engine_id, "epoch": self.epoch,
            "state": str(HandshakeState.SUCCEEDED if self.ok else HandshakeState.FAILED),
            "time": self.time or utc_timestamp(),
            "message": self.message[:HANDSHAKE_MESSAGE_MAX],
        }
        if self.transport:
            values.update(transport=self.transport[:TRANSPORT_MAX],
                          transport_detail=self.transport_detail[:HANDSHAKE_MESSAGE_MAX])
        return document(HANDSHAKE_FIELDS, values)


class TransferResult(NamedTuple):
    """Outcome of :meth:`AgentService.pull`, :meth:`~AgentService.push` or
    :meth:`~AgentService.wait_received`: ``ok`` or a typed ``cause`` with a message (a
    NamedTuple: one per request, cheap to build)."""

    request_id: str
    ok: bool
    nbytes: int = 0
    descs: int = 0
    parts: int = 0
    seconds: float = 0.0
    cause: str = ""
    message: str = ""

    @property
    def throughput_gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
