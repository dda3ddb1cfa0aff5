"""kvbridge NIXL data plane: registration, pull (READ) and push (WRITE) transfers.

Reading order (one job per module):

- :mod:`._loader`       import the installed NIXL build (``nixl``, ``nixl_cu12``, ``nixl_cu13``)
- :mod:`._memtypes`      logical memory kind -> NIXL memory type (production vs CPU tests)
- :mod:`._agent`         :class:`NixlAgent`: one NIXL agent (progress-thread delay patched),
                        registrations, prepared lists, peers, transfers, notifications
- :mod:`._local`         :class:`LocalEngine`: this engine's registered plan + local lists
- :mod:`._remote`        :class:`RemoteEngine`: a remote rank's geometry (from v11 metadata)
- :mod:`._peers`         remote agents and the lists prepared against them (stale drop)
- :mod:`._readplan`      pure id planning of a pull (group-matched / region-mapped)
- :mod:`._coalesce`      merging of descriptors adjacent on both sides
- :mod:`._pull`          :class:`PullEngine` (decode side, READ, deferred notification)
- :mod:`._push`          :class:`PushEngine` (prefill side, WRITE + notification)
- :mod:`._producer`      :class:`CompletionTracker`: notification counting and leases
- :mod:`._heartbeat`     :class:`HeartbeatSender`: consumer-side lease heartbeats
- :mod:`._notifications` the ``"req:n"`` / ``"HB:..."`` wire formats
- :mod:`._errors`        :class:`FailureCause`, :class:`TransferFailure`, exceptions

Coalescing decision: see ``DEFAULT_COALESCE`` in :mod:`._pull` and the numbers below.

COALESCING_NOTES
"""

from ._agent import LOCAL_AGENT, AgentConfig, DList, NixlAgent, XferHandle, XferState
from ._errors import (
    DataPlaneError,
    FailureCause,
    NixlCallError,
    RemoteNotFoundError,
    TransferFailure,
    UnsupportedTransferError,
)
from ._heartbeat import HeartbeatSender
from ._inflight import RequestState, TransferDone
from ._loader import NixlUnavailableError, load_nixl
from ._local import EngineFacts, LocalEngine, LocalLists
from ._memtypes import CPU_TEST_MEM_TYPES, PRODUCTION_MEM_TYPES, MemTypeMap
from ._notifications import (
    Completion,
    Heartbeat,
    NotificationError,
    completion_message,
    heartbeat_message,
    parse_notification,
)
from ._producer import DEFAULT_LEASE_S, CompletionTracker, ReleaseReason
from ._pull import DEFAULT_COALESCE, PollResult, PullEngine, PullRequest
from ._push import PushEngine, PushRequest
from ._readplan import ReadIds, plan_read_ids
from ._remote import RemoteEngine

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
