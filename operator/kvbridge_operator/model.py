"""The planner's output types and the wire-field -> KVEndpoint-path mapping. Pure.

The state values (:class:`EndpointState`, :class:`PairState`) are the shared status table's
(``kvbridge_agent.resources``), re-exported here where the operator has always named them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge_agent.resources import PEER_FIELDS, EndpointState, PairState, document, endpoint_path

if TYPE_CHECKING:  # revisions.py builds on these types
    from .revisions import RevisionCount

__all__ = [
    "DesiredCondition",
    "EndpointPlan",
    "EndpointState",
    "Pair",
    "PairState",
    "Peer",
    "Plan",
    "Problem",
    "RoleCounts",
    "TransportFallback",
    "endpoint_field",
]


@dataclass(frozen=True)
class Peer:
    name: str
    engine_id: str
    role: str
    host: str
    port: int
    tp_rank: int
    tp_size: int
    epoch: int

    def to_dict(self) -> dict[str, Any]:
        """The ``status.peers`` item."""
        return document(PEER_FIELDS, vars(self))


@dataclass(frozen=True)
class EndpointPlan:
    """The operator's verdict for one KVEndpoint."""

    name: str
    role: str
    state: EndpointState
    reason: str
    message: str
    peers: tuple[Peer, ...] = ()
    handshake: PairState | None = None  # decode endpoints with peers only


@dataclass(frozen=True)
class Problem:
    """Why an endpoint was not paired: the rule, the KVEndpoint field, a sentence."""

    endpoint: str
    role: str
    rule: str
    field: str
    message: str


@dataclass(frozen=True)
class Pair:
    decode_engine: str
    prefill_engine: str
    state: PairState
    #: UCX transports its decode ranks report for their prefill peers, sorted
    transports: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransportFallback:
    """A verified rank pair whose reported transport the KVTransfer does not accept."""

    endpoint: str  # the reporting (decode) rank's KVEndpoint
    peer: str  # the prefill rank's KVEndpoint
    transport: str


@dataclass(frozen=True)
class RoleCounts:
    engines: int = 0
    endpoints: int = 0
    incompatible: int = 0
    stale: int = 0
    incomplete: int = 0
    paired: int = 0
    verified: int = 0


@dataclass(frozen=True)
class DesiredCondition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    endpoints: tuple[EndpointPlan, ...]  # sorted by name
    pairs: tuple[Pair, ...]  # sorted by (decode, prefill)
    prefill: RoleCounts
    decode: RoleCounts
    problems: tuple[Problem, ...]  # sorted by endpoint name
    incompatible_pairs: int  # (decode engine, prefill engine) pairs failing a rule
    conditions: tuple[DesiredCondition, ...]
    summary: str
    fallbacks: tuple[TransportFallback, ...] = ()  # sorted by (endpoint, peer)
    #: per model identity, sorted by label
    revisions: tuple[RevisionCount, ...] = ()

    def endpoint(self, name: str) -> EndpointPlan:
        return next(e for e in self.endpoints if e.name == name)

    @property
    def verified_pairs(self) -> int:
        return sum(1 for p in self.pairs if p.state is PairState.VERIFIED)


#: A :class:`~kvbridge_agent.protocol.Incompatibility` field as the KVEndpoint path users read
#: (derived from the agent's KVEndpoint field table).
endpoint_field = endpoint_path
