"""kvbridge NIXL data plane: registration, pull (READ) and push (WRITE) transfers.

Reading order (one job per module):

- :mod:`._loader`       import the installed NIXL build (``nixl``, ``nixl_cu12``, ``nixl_cu13``)
- :mod:`._memtypes`      logical memory kind -> NIXL memory type (production vs CPU tests)
- :mod:`._agent`         :class:`NixlAgent`: one NIXL agent (progress-thread delay patched),
                        registrations, prepared lists, peers, transfers, notifications
- :mod:`._local`         :class:`LocalEngine`: this engine's registered plan + local lists
- :mod:`._remote`        :class:`RemoteEngine`: a remote rank's geometry (from v11 metadata)
- :mod:`._transport`     which UCX transport reaches each peer (UCX's protocol tables)
- :mod:`._peers`         remote agents and the lists prepared against them (stale drop)
- :mod:`._readplan`      pure id planning of a pull (group-matched / region-mapped)
- :mod:`._coalesce`      merging of descriptors adjacent on both sides
- :mod:`._pull`          :class:`PullEngine` (decode side, READ, deferred notification)
- :mod:`._push`          :class:`PushEngine` (prefill side, WRITE + notification)
- :mod:`._producer`      :class:`CompletionTracker`: notification counting and leases
- :mod:`._heartbeat`     :class:`HeartbeatSender`: consumer-side lease heartbeats
- :mod:`._notifications` the ``"req:n"`` / ``"HB:..."`` wire formats
- :mod:`._errors`        :class:`FailureCause`, :class:`TransferFailure`, exceptions

Public API for a vLLM integration: build a :class:`NixlAgent` (``AgentConfig``; the
``PRODUCTION_MEM_TYPES`` map), a :class:`LocalEngine` from the KV ``CacheView`` objects and
:class:`EngineFacts`; on the decode side a :class:`PullEngine` (``add_remote`` with a
:class:`RemoteEngine` built by ``RemoteEngine.from_metadata`` after the handshake, then
``start(PullRequest)`` in ``start_load_kv`` and ``poll()`` in ``get_finished``, or
``wait()``); on the prefill side a :class:`CompletionTracker` (``register`` when a request
finishes prefill, ``poll(agent)`` + ``take_finished()`` in ``get_finished``) or a
:class:`PushEngine` in push mode.

Coalescing decision (``coalesce=`` on the engines, ``DEFAULT_COALESCE = False``):
NIXL 1.5.1 already merges descriptors that are adjacent on both sides inside
``make_prepped_xfer`` (telemetry ``descCount``: 64 contiguous 73,728-byte blocks became 1
descriptor; every other block stayed 64). Our merged one-shot transfer therefore moves the
same descriptors as the prepared path and only adds a table gather plus
``get_xfer_descs``/``initialize_xfer`` (about 0.2-0.4 ms per part). ``bench_transfer.py``
(2 vCPUs shared with other jobs, load average 8-10; median of 25 back-to-back paired reps,
cross-process pull of 61 regions x 64 blocks x 73,728 B = 288 MB):

====================================  =====  =====  =====
ratio (run 1 / 2 / 3)                  1      2      3
====================================  =====  =====  =====
contiguous: coalesced / prepared       0.967  1.001  1.059
scattered:  coalesced / prepared       0.995  0.995  0.961
contiguous: coalesced / numpy memcpy   0.837  0.833  0.933
contiguous: prepared / numpy memcpy    0.872  0.868  0.924
====================================  =====  =====  =====

Run-to-run noise on this shared machine is about +-5 %, the size of every difference here.
No win, so it is off by default. Keep it for NIXL builds or backends that do not merge
(e.g. ``skip_desc_merge``); measure with ``bench/bench_transfer.py`` before turning it on.
"""

from ._agent import LOCAL_AGENT, AgentConfig, DList, NixlAgent, XferHandle, XferState
from ._engine import PollResult, TransferEngine
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
    HEARTBEAT_PREFIX,
    Completion,
    Heartbeat,
    NotificationError,
    completion_message,
    heartbeat_message,
    parse_notification,
)
from ._producer import DEFAULT_LEASE_S, CompletionTracker, ReleaseReason, heartbeat_extension_s
from ._pull import DEFAULT_COALESCE, PullEngine, PullRequest
from ._push import PushEngine, PushRequest
from ._readplan import ReadIds, plan_read_ids
from ._remote import RemoteEngine
from ._transport import PeerTransport

__all__ = [
    "CPU_TEST_MEM_TYPES",
    "DEFAULT_COALESCE",
    "DEFAULT_LEASE_S",
    "HEARTBEAT_PREFIX",
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
    "PeerTransport",
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
    "TransferEngine",
    "TransferFailure",
    "UnsupportedTransferError",
    "XferHandle",
    "XferState",
    "completion_message",
    "heartbeat_extension_s",
    "heartbeat_message",
    "load_nixl",
    "parse_notification",
    "plan_read_ids",
]
