"""What the agent service's collaborators share: its one lock and its NIXL handles.

Lock order (the one place it is stated). An agent takes its locks in this order only, and
never waits on a socket while holding any of them:

1. a host's own lock (``KVBridgeWorker._lock``): a leaf, never held while calling the agent;
2. :attr:`Core.lock`, the service's one re-entrant lock: every NIXL call, and all state of
   the peers, the transfers and the receiver, happens under it. The progress thread, the
   caller's thread and ``EndpointSync``'s thread all take it; :attr:`Core.cond` (on the same
   lock) wakes the waiters of a transfer or a receipt. ``CompletionTracker`` calls back into
   the receiver with it held;
3. leaves taken under it: NIXL's construction lock (``nixl._agent``), the side-channel
   server's statistics lock.

Side-channel fetches (handshakes) run without :attr:`Core.lock`, so a slow peer never stalls
transfers; what they fetch is loaded under it afterwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._types import AgentClosedError, AgentSettings, EngineInfo, Side

if TYPE_CHECKING:   # NIXL builds load when an agent starts, not at import
    from ..nixl import CompletionTracker, LocalEngine, NixlAgent, PullEngine, PushEngine

__all__ = ["Core"]


@dataclass(eq=False)
class Core:
    """One agent's identity, lock and NIXL handles (``start`` sets them, ``close`` clears)."""

    agent_name: str
    engine: EngineInfo
    settings: AgentSettings
    side: Side
    lock: threading.RLock = field(default_factory=threading.RLock)
    cond: threading.Condition = field(init=False)
    agent: NixlAgent | None = None
    local: LocalEngine | None = None
    #: the engine that moves bytes (a puller's PullEngine, a pusher's PushEngine)
    mover: PullEngine | PushEngine | None = None
    #: completion notifications of the other side (a receiver, or kv_both's producer)
    tracker: CompletionTracker | None = None

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def closed(self) -> AgentClosedError:
        return AgentClosedError(f"agent {self.agent_name} is not started or closed")
