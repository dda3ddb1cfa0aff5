"""Consumer-side lease heartbeats (spec §1.8).

The consumer keeps the producer's blocks alive while it still intends to read them by
sending ``"HB:" + ",".join(request_ids)`` to each producer agent every ``lease_s / 6``
seconds. Send failures are logged and counted, never raised: the worst outcome of a lost
heartbeat is a lease expiry, which the consumer sees as a failed read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ._notifications import heartbeat_message
from ._producer import DEFAULT_LEASE_S

__all__ = ["HeartbeatSender"]

log = logging.getLogger(__name__)


class HeartbeatSender:
    """Tracks which request ids each producer agent holds for us and heartbeats them.

    Args:
        send: ``send(peer_agent_name, message)``, e.g. ``NixlAgent.send_notif``.
        lease_s: the producer's lease; heartbeats go out every ``lease_s / 6``.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        send: Callable[[str, bytes], None],
        *,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.interval_s = float(lease_s) / 6.0
        self._clock = clock
        self._ids: dict[str, dict[str, None]] = {}   # peer -> ordered set of request ids
        self._next_due = clock() + self.interval_s
        self.failures = 0

    def track(self, peer: str, request_id: str) -> None:
        self._ids.setdefault(peer, {})[request_id] = None

    def untrack(self, request_id: str) -> None:
        for ids in self._ids.values():
            ids.pop(request_id, None)

    def forget_peer(self, peer: str) -> None:
        self._ids.pop(peer, None)

    def tracked(self, peer: str) -> tuple[str, ...]:
        return tuple(self._ids.get(peer, ()))

    def tick(self, now: float | None = None, *, force: bool = False) -> int:
        """Send due heartbeats; returns how many messages went out."""
        now = self._clock() if now is None else now
        if not force and now < self._next_due:
            return 0
        self._next_due = now + self.interval_s
        sent = 0
        for peer, ids in list(self._ids.items()):
            if not ids:
                continue
            try:
                self._send(peer, heartbeat_message(tuple(ids)))
                sent += 1
            except Exception as exc:  # a dead peer: its leases are gone anyway
                self.failures += 1
                log.warning("heartbeat to %s failed: %s", peer, exc)
        return sent
