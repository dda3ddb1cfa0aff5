"""Producer-side completion accounting and leases (spec §1.8, §4.7).

The producer (P in pull mode, D in push mode) holds a request's blocks until every consumer
has told it the transfer finished, or until the request's lease expires. State per request:
the announced consumer count, the count received so far and a lease deadline. Heartbeats
(``"HB:id,..."``) extend leases to ``max(old, now + lease * 2/3)``.

Not thread-safe; call from the thread that owns the NIXL agent. The clock is injectable
(monotonic seconds) so lease logic is testable without sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ._notifications import Completion, Heartbeat, NotificationError, parse_notification

__all__ = ["DEFAULT_LEASE_S", "CompletionTracker", "ReleaseReason", "heartbeat_extension_s"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


def heartbeat_extension_s(lease_s: float) -> float:
    """How far a heartbeat moves a lease: ``now + lease * 2/3`` (vLLM's rule). A decode
    that knows a producer's lease uses this to keep its deadline true."""
    return float(lease_s) * 2.0 / 3.0


class ReleaseReason:
    COMPLETED = "completed"
    EXPIRED = "expired"


@dataclass
class _Lease:
    expiry: float
    expected: int | None = None
    received: int = 0
    senders: list[str] = field(default_factory=list)


class CompletionTracker:
    """Counts completion notifications per request and frees on the announced count.

    Args:
        lease_s: lease length; default 30 s.
        on_release: called as ``on_release(request_id, reason)`` when a request is freed
            (``ReleaseReason.COMPLETED`` or ``EXPIRED``); it is also added to the set
            returned by :meth:`take_finished` / :meth:`take_expired`.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        on_release: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s: expected > 0, got {lease_s}")
        self.lease_s = float(lease_s)
        self._on_release = on_release
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._finished: set[str] = set()
        self._expired: set[str] = set()
        self._warned_unknown: set[str] = set()
        self.bad_notifications = 0

    # -- registration -----------------------------------------------------------------
    def register(self, request_id: str, *, lease_s: float | None = None) -> float:
        """Start holding ``request_id``; returns its lease deadline (monotonic)."""
        expiry = self._clock() + (self.lease_s if lease_s is None else float(lease_s))
        self._leases[request_id] = _Lease(expiry=expiry)
        self._warned_unknown.discard(request_id)
        return expiry

    def set_lease(self, request_id: str, lease_s: float) -> None:
        """Set a held request's deadline to ``lease_s`` from now, keeping its count."""
        lease = self._leases.get(request_id)
        if lease is not None:
            lease.expiry = self._clock() + float(lease_s)

    def forget(self, request_id: str) -> None:
        """Stop holding ``request_id`` without reporting it (an aborted request)."""
        self._leases.pop(request_id, None)

    def pending(self) -> tuple[str, ...]:
        return tuple(self._leases)

    def expiry(self, request_id: str) -> float | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.expiry

    def received(self, request_id: str) -> int:
        lease = self._leases.get(request_id)
        return 0 if lease is None else lease.received

    # -- notifications ------------------------------------------------------------------
    def process(self, notifs: Mapping[str, Iterable[bytes]]) -> None:
        """Feed ``{sender: [message, ...]}`` as drained from a NIXL agent."""
        for sender, messages in notifs.items():
            for message in messages:
                self.process_one(sender, message)

    def process_one(self, sender: str, message: bytes) -> None:
        try:
            note = parse_notification(message)
        except NotificationError as exc:
            self.bad_notifications += 1
            log.warning("ignoring notification from %s: %s", sender, exc)
            return
        if isinstance(note, Heartbeat):
            self._heartbeat(note.request_ids)
        else:
            self._complete(sender, note)

    def _unknown(self, request_id: str, what: str) -> None:
        if request_id in self._warned_unknown:
            return
        self._warned_unknown.add(request_id)
        log.warning("%s for unknown request %r (finished, expired or never registered); "
                    "ignored", what, request_id)

    def _heartbeat(self, request_ids: Iterable[str]) -> None:
        extended = self._clock() + heartbeat_extension_s(self.lease_s)
        for rid in request_ids:
            lease = self._leases.get(rid)
            if lease is None:
                self._unknown(rid, "heartbeat")
                continue
            lease.expiry = max(lease.expiry, extended)

    def _complete(self, sender: str, note: Completion) -> None:
        lease = self._leases.get(note.request_id)
        if lease is None:
            self._unknown(note.request_id, "completion notification")
            return
        if lease.expected is not None and lease.expected != note.consumers:
            log.warning("request %r: consumer count changed from %d to %d (sender %s)",
                        note.request_id, lease.expected, note.consumers, sender)
        lease.expected = note.consumers
        lease.received += 1
        lease.senders.append(sender)
        if lease.received >= lease.expected:
            del self._leases[note.request_id]
            self._release(note.request_id, ReleaseReason.COMPLETED)

    def _release(self, request_id: str, reason: str) -> None:
        (self._finished if reason == ReleaseReason.COMPLETED else self._expired).add(request_id)
        if self._on_release is not None:
            self._on_release(request_id, reason)

    # -- time ---------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[str]:
        """Free every request whose lease has passed; returns their ids."""
        now = self._clock() if now is None else now
        gone = [rid for rid, lease in self._leases.items() if lease.expiry <= now]
        for rid in gone:
            del self._leases[rid]
            log.info("request %r: lease expired without completion; freeing", rid)
            self._release(rid, ReleaseReason.EXPIRED)
        return gone

    def take_finished(self) -> set[str]:
        """Requests freed by completion since the last call (vLLM ``finished_sending``)."""
        out, self._finished = self._finished, set()
        return out

    def take_expired(self) -> set[str]:
        """Requests freed by lease expiry since the last call."""
        out, self._expired = self._expired, set()
        return out

    def poll(self, agent: object) -> None:
        """Drain ``agent.get_notifs()`` (a :class:`~.agent.NixlAgent`) and expire leases."""
        self.process(agent.get_notifs())  # type: ignore[attr-defined]
        self.expire()
