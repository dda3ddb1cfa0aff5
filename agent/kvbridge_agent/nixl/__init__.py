"""kvbridge NIXL data plane: registration, pull (READ) and push (WRITE) transfers.

Reading order (one job per module):

- :mod:`._loader`       import the installed NIXL build (``nixl``, ``nixl_cu12``, ``nixl_cu13``)
- :mod:`.memtypes`      logical memory kind -> NIXL memory type (production vs CPU tests)
- :mod:`.agent`         :class:`NixlAgent`: one NIXL agent (progress-thread delay patched),
                        registrations, prepared lists, peers, transfers, notifications
- :mod:`.local`         :class:`LocalEngine`: this engine's registered plan + local lists
- :mod:`.remote`        :class:`RemoteEngine`: a remote rank's geometry (from v11 metadata)
- :mod:`.peers`         remote agents and the lists prepared against them (stale drop)
- :mod:`.readplan`      pure id planning of a pull (group-matched / region-mapped)
- :mod:`.coalesce`      merging of descriptors adjacent on both sides
- :mod:`.pull`          :class:`PullEngine` (decode side, READ, deferred notification)
- :mod:`.push`          :class:`PushEngine` (prefill side, WRITE + notification)
- :mod:`.producer`      :class:`CompletionTracker`: notification counting and leases
- :mod:`.heartbeat`     :class:`HeartbeatSender`: consumer-side lease heartbeats
- :mod:`.notifications` the ``"req:n"`` / ``"HB:..."`` wire formats
- :mod:`.errors`        :class:`FailureCause`, :class:`TransferFailure`, exceptions

Coalescing decision: see ``DEFAULT_COALESCE`` in :mod:`.pull` and the numbers below.

COALESCING_NOTES
"""

from ._inflight import RequestState, TransferDone
from ._loader import NixlUnavailableError, load_nixl
from .agent import LOCAL_AGENT, AgentConfig, DList, NixlAgent, XferHandle, XferState
from .errors import (
    DataPlaneError,
    FailureCause,
    NixlCallError,
    RemoteNotFoundError,
    TransferFailure,
    UnsupportedTransferError,
)
from .heartbeat import HeartbeatSender
from .local import EngineFacts, LocalEngine, LocalLists
from .memtypes import CPU_TEST_MEM_TYPES, PRODUCTION_MEM_TYPES, MemTypeMap
from .notifications import (
    Completion,
    Heartbeat,
    NotificationError,
    completion_message,
    heartbeat_message,
    parse_notification,
)
from .producer import DEFAULT_LEASE_S, CompletionTracker, ReleaseReason
from .pull import DEFAULT_COALESCE, PollResult, PullEngine, PullRequest
from .push import PushEngine, PushRequest
from .readplan import ReadIds, plan_read_ids
from .remote import RemoteEngine

__all__ = [
    "CPU_TEST_MEM_TYPES",
    "DEFAULT_COALESCE",
    "DEFAULT_LEASE_S",
    "LOCAL_AGENT",
    "PRODUCTION_MEM_TYPES",
    "AgentConfig",
    "Completion",
    "CompletionTracker",
    "DList",
    "DataPlaneError",
    "EngineFacts",
    "FailureCause",
    "Heartbeat",
    "HeartbeatSender",
    "LocalEngine",
    "LocalLists",
    "MemTypeMap",
    "NixlAgent",
    "NixlCallError",
    "NixlUnavailableError",
    "NotificationError",
    "PollResult",
    "PullEngine",
    "PullRequest",
    "PushEngine",
    "PushRequest",
    "ReadIds",
    "ReleaseReason",
    "RemoteEngine",
    "RemoteNotFoundError",
    "RequestState",
    "TransferDone",
    "TransferFailure",
    "UnsupportedTransferError",
    "XferHandle",
    "XferState",
    "completion_message",
    "heartbeat_message",
    "load_nixl",
    "parse_notification",
    "plan_read_ids",
]
