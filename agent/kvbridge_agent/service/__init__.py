"""The agent orchestrator: register KV caches, serve the v11 side channel, preflight the
peers the operator assigns, and run transfers against them (DESIGN flows 1, 4, 5, 6).

:class:`AgentService` wires the halves of the agent together:

- **register** (flow 1): a :class:`~.nixl.NixlAgent` named ``<engine>-tp<rank>-e<epoch>``
  (a new name per start, so peers never confuse a restarted agent with its predecessor), a
  :class:`~.nixl.LocalEngine` over the caller's ``CacheView`` objects, the v11
  ``NixlAgentMetadata`` built from what was actually registered, and a
  :class:`~.sidechannel.SideChannelServer` serving it;
- **publish** (flow 2) is the caller's: :func:`~.kube.endpoint_spec` is the KVEndpoint
  spec for exactly this registration;
- **preflight** (flow 4): :meth:`set_peers` takes the operator's assigned peers (from the
  KVEndpoint status), drops peers that went away or changed epoch (removing their NIXL
  remote agent), handshakes with every new one (side channel, hash, engine id, then
  ``protocol.validate_remote``) and loads it into NIXL. Results are :class:`PeerReport`
  items, which :mod:`.kube` writes to ``status.handshakes``;
- **transfer** (flow 5), by the agent's :class:`Side`, chosen once from role and mode (spec
  §4, §5): a PULLER or PUSHER moves bytes, a RECEIVER waits for the other side's
  completion notifications. A call another side makes raises :class:`WrongSideError`; every
  error of the service derives from :class:`AgentError`, and handshakes end in a
  :class:`HandshakeOutcome`:

  ============  ===========================================  ===================================
  mode          prefill                                      decode
  ============  ===========================================  ===================================
  ``pull``      :meth:`hold` / :meth:`completions`: counts   :meth:`pull`: READs from a
                D's completion notifications                 preflighted peer, then notifies it
                (:class:`~.nixl.CompletionTracker`)          (:class:`~.nixl.PullEngine`)
  ``push``      :meth:`push`: WRITEs into a preflighted D    :meth:`expect` / :meth:`wait_received`
                peer, the notification travels with the      / :meth:`completions`: counts P's
                WRITE (:class:`~.nixl.PushEngine`)           notifications (``CompletionTracker``)
  ============  ===========================================  ===================================

  No transfer handshakes on the request path. Whoever moves the bytes loads the other side's
  memory description at preflight: D loads P in pull mode, P loads D in push mode (P writes
  into D's memory); the other side loads only the peer's NIXL agent, which is what accepting
  its notifications (pull) or WRITEs (push) needs. Push refuses what vLLM's
  ``NixlPushConnector`` refuses (spec §5): mixed-memory caches, at :meth:`start` on either
  side and at preflight for a peer; different cache-group layouts, at preflight.

The facade delegates to one collaborator per concern: :class:`~._peers.PeerSet` (the
assigned peers and their handshakes), :class:`~._transfers.Transfers` (the mover's requests
and outcomes), :class:`~._receiver.Receiver` (holds, leases, expected receipts) and
:class:`~._requests.RequestBuilder` (every pull, start-pull and push request).

Threads: NIXL is not assumed thread-safe, so every NIXL call happens under one lock, which
the collaborators share; ``_core`` states the lock order. A progress thread polls the pull or
push engine (heartbeats, asynchronous completions) or the notifications of the side that
waits for them every ``progress_interval_s``. Side-channel fetches run without the lock.
Every wait has a deadline.
"""

from ._agent import AgentService
from ._types import (
    HANDSHAKE_MESSAGE_MAX,
    TRANSPORT_MAX,
    AgentClosedError,
    AgentError,
    AgentSettings,
    EngineInfo,
    HandshakeOutcome,
    PeerRef,
    PeerReport,
    Side,
    StalePeerError,
    TransferResult,
    UnknownRequestError,
    WrongSideError,
)

__all__ = [
    "HANDSHAKE_MESSAGE_MAX",
    "TRANSPORT_MAX",
    "AgentClosedError",
    "AgentError",
    "AgentService",
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
