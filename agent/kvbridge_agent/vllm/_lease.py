"""Lease deadlines between a kvbridge prefill and a kvbridge decode (pure logic).

A prefill frees a finished request's blocks when its lease runs out; a decode that reads
them later reads freed, possibly reused, blocks. The prefill therefore states the deadline
in the ``kv_transfer_params`` it returns (vLLM's ``remote_blocks_expiry_time``, on the
prefill's ``perf_counter``) with the extension its heartbeats grant
(``kvbridge_lease_extension_s``). The decode converts the deadline to its own clock with
the offset its handshake measured, moves it by the heartbeats it sent while the request
waited, and declines a read that cannot start ``margin`` before it. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LEASE_MARGIN_S",
    "EXPIRY_KEY",
    "EXTENSION_KEY",
    "READ_ALLOWANCE_S",
    "HeartbeatLog",
    "ReadDecision",
    "decide_read",
    "read_deadline",
]

#: vLLM's field for a block deadline, on the producer's ``perf_counter``.
EXPIRY_KEY = "remote_blocks_expiry_time"
#: kvbridge's: seconds a heartbeat extends the prefill's lease by (``lease * 2/3``).
EXTENSION_KEY = "kvbridge_lease_extension_s"
#: Time a read must be able to start before the deadline: the read-start heartbeat's
#: delivery and an engine step on both sides (the clock error is added to it).
DEFAULT_LEASE_MARGIN_S = 2.0


def read_deadline(stated: float, heartbeats: Sequence[float], extension_s: float | None,
                  margin_s: float) -> float:  # fmt: skip
    """The prefill's deadline on the decode's clock, after the heartbeats sent at
    ``heartbeats`` (local send times, ascending). A heartbeat extends the lease to
    ``sent + extension_s`` only if it could reach the prefill ``margin_s`` before the
    deadline it extended; without ``extension_s`` heartbeats count for nothing."""
    deadline = stated
    if extension_s is None or extension_s <= 0:
        return deadline
    for sent in heartbeats:
        if sent + margin_s < deadline:
            deadline = max(deadline, sent + extension_s)
    return deadline


#: A read with at least this long (or its whole transfer timeout, if shorter) before the
#: deadline needs no heartbeat first: healthy reads take milliseconds.
READ_ALLOWANCE_S = 5.0


@dataclass(frozen=True)
class ReadDecision:
    """Whether to read; the seconds left before the deadline; the read's own deadline
    (seconds from now), which ends while the prefill still holds the blocks; and whether a
    heartbeat must precede the read to make the prefill hold them that long."""

    read: bool
    left_s: float
    timeout_s: float
    heartbeat: bool = False


def decide_read(now: float, deadline: float, *, margin_s: float, clock_error_s: float,
                extension_s: float | None, transfer_timeout_s: float) -> ReadDecision:  # fmt: skip
    """Read only if ``now`` is more than ``margin_s + clock_error_s`` (the guard) before
    ``deadline``. The read must end a guard before the prefill may free the blocks and
    within ``transfer_timeout_s``. When the deadline leaves it less than
    ``READ_ALLOWANCE_S`` (or than its transfer timeout, if shorter), a heartbeat goes first,
    so the prefill holds the blocks until ``now + extension_s`` at least."""
    guard = margin_s + clock_error_s
    left = deadline - now
    if left <= guard:
        return ReadDecision(False, left, 0.0)
    budget = left - guard
    if budget >= min(transfer_timeout_s, READ_ALLOWANCE_S) or not extension_s:
        return ReadDecision(True, left, min(transfer_timeout_s, budget))
    held = max(budget, extension_s - guard)
    return ReadDecision(True, left, min(transfer_timeout_s, held), heartbeat=held > budget)


class HeartbeatLog:
    """When this decode sent heartbeats for each remote request, kept until its read.

    Keyed by ``(remote engine id, remote request id)``. Bounded: a request keeps at most
    ``per_request`` send times (dropping the oldest only weakens a deadline, never
    strengthens it: without the early ones the chain of extensions starts later), and
    entries older than ``max_age_s`` are dropped when new heartbeats are recorded."""

    def __init__(self, per_request: int = 64, max_age_s: float = 3600.0) -> None:
        self.per_request = per_request
        self.max_age_s = max_age_s
        self._sent: dict[tuple[str, str], list[float]] = {}

    def record(self, engine_id: str, request_ids: Iterable[str], now: float) -> None:
        for rid in request_ids:
            times = self._sent.setdefault((engine_id, rid), [])
            times.append(now)
            if len(times) > self.per_request:
                del times[0]
        if len(self._sent) > 1024:
            self.prune(now)

    def take(self, engine_id: str, request_id: str) -> list[float]:
        """The send times for one request (ascending), forgetting them."""
        return self._sent.pop((engine_id, request_id), [])

    def prune(self, now: float) -> None:
        stale = [k for k, t in self._sent.items() if now - t[-1] > self.max_age_s]
        for key in stale:
            del self._sent[key]

    def __len__(self) -> int:
        return len(self._sent)
