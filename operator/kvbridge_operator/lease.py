"""Leader election on a ``coordination.k8s.io/v1`` Lease: the decisions, without I/O.

The protocol is client-go's (``k8s.io/client-go/tools/leaderelection``), which
kube-controller-manager, kube-scheduler, cert-manager and Argo CD use:

- Every replica tries, every ``retry_period``, to acquire or renew the Lease: it reads the
  Lease and writes it back with the ``resourceVersion`` it read, so of two replicas writing at
  once one gets 409 Conflict and stays a standby.
- A standby never trusts the times written in the Lease (its clock is not the leader's). It
  notes, on its own monotonic clock, when it first saw the Lease's current version
  (:class:`Observation`), and takes the Lease over once ``leaseDurationSeconds`` have passed
  since without a new version, or at once when the holder released it (empty
  ``holderIdentity``).
- The leader acts only until ``renew_deadline`` after the *start* of its last successful
  renewal (:class:`Term`); after that it writes nothing, whatever happens later.

Why that keeps two replicas from acting at once: a renewal started at ``t`` reaches the API
server after ``t``, so a standby sees it at ``t`` or later and takes over no sooner than
``t + lease_duration``; the leader stopped at ``t + renew_deadline``, earlier by
``lease_duration - renew_deadline`` (5 s by default), a margin for a write already sent at the
deadline and for the two monotonic clocks running at slightly different rates. Like client-go's,
this is no fence: a write delayed beyond that margin (a frozen process, a network holding a
request for seconds) could still land after the new leader's; the new leader then sees it on
its watch and plans again.

:class:`Timing` checks the same constraints as client-go: ``lease_duration > renew_deadline``
and ``renew_deadline > retry_period`` (a leader gets more than one try before it stops).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Action",
    "Observation",
    "Record",
    "Term",
    "Timing",
    "decide",
    "lease_body",
    "next_try_in",
    "observe",
    "released_body",
]


@dataclass(frozen=True)
class Timing:
    """Seconds of the election (client-go's defaults for its components: 15, 10, 2)."""

    lease_duration: int = 15
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.lease_duration, bool) or not isinstance(self.lease_duration, int):
            raise ValueError(f"lease duration: whole seconds expected, got {self.lease_duration!r}")
        if self.retry_period <= 0:
            raise ValueError(f"retry period must be > 0, got {self.retry_period}")
        if not self.renew_deadline > self.retry_period:
            raise ValueError(f"renew deadline ({self.renew_deadline} s) must be longer than the "
                             f"retry period ({self.retry_period} s)")  # fmt: skip
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(f"lease duration ({self.lease_duration} s) must be longer than the "
                             f"renew deadline ({self.renew_deadline} s)")  # fmt: skip


@dataclass(frozen=True)
class Record:
    """What a Lease says (``spec`` and ``metadata.resourceVersion``)."""

    holder: str
    duration: int
    transitions: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    version: str = ""

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> Record:
        """From a Lease as JSON (the API's answer, not the client's model objects)."""
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            duration=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
        )


@dataclass(frozen=True)
class Observation:
    """The Lease as last read (None: there is none) and the monotonic time its current version
    was first seen here (client-go's ``observedTime``)."""

    record: Record | None
    at: float


def observe(previous: Observation | None, record: Record | None, now: float) -> Observation:
    """The observation after reading ``record`` at ``now``: unchanged while the Lease is the
    same version (its expiry counts from when it was first seen), else new."""
    if previous is not None:
        old = previous.record
        if (old is None and record is None) or (
            old is not None and record is not None and old.version == record.version
        ):
            return previous
    return Observation(record, now)


class Action(enum.Enum):
    """What to do after reading the Lease."""

    CREATE = "create"  # no Lease yet: create it, held by us
    TAKE = "take"  # released or expired: write it as ours (a new holder)
    RENEW = "renew"  # ours: write a new renewTime
    WAIT = "wait"  # another replica holds it and it has not expired: stand by


def decide(obs: Observation, identity: str, now: float) -> Action:
    """Acquire, renew or stand by, from the observation alone (see the module docstring)."""
    record = obs.record
    if record is None:
        return Action.CREATE
    if record.holder == identity:
        return Action.RENEW
    if not record.holder or now >= obs.at + record.duration:
        return Action.TAKE
    return Action.WAIT


def next_try_in(obs: Observation | None, identity: str, now: float, timing: Timing) -> float:
    """Seconds until the next try: a retry period, or less when another replica's Lease
    expires sooner (so a standby takes over at expiry, not up to a retry period after)."""
    record = obs.record if obs is not None else None
    if obs is None or record is None or not record.holder or record.holder == identity:
        return timing.retry_period
    return max(0.0, min(timing.retry_period, obs.at + record.duration - now))


@dataclass
class Term:
    """The leader's own clock: it may act until ``renew_deadline`` after the start of its last
    successful acquire or renew. Once that has passed the term is over for good: a replica
    that lapsed never acts again (the operator then exits, see :mod:`.leader`)."""

    renew_deadline: float
    started: float | None = None
    lapsed: bool = False

    def leading(self, now: float) -> bool:
        if self.started is None or self.lapsed:
            return False
        if now >= self.started + self.renew_deadline:
            self.lapsed = True
            return False
        return True

    def renewed(self, attempt_started: float) -> bool:
        """Record a successful write of the Lease by an attempt that started at
        ``attempt_started``; False (and nothing extended) when the term had already lapsed."""
        if self.lapsed or (
            self.started is not None and attempt_started >= self.started + self.renew_deadline
        ):
            self.lapsed = self.started is not None
            return False
        self.started = attempt_started
        return True

    def deadline(self) -> float | None:
        return None if self.started is None else self.started + self.renew_deadline


def micro_time(when: dt.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(action: Action, record: Record | None, identity: str, timing: Timing,
               now: dt.datetime, *, name: str, namespace: str) -> dict[str, Any]:  # fmt: skip
    """The Lease to write for ``action`` (CREATE, TAKE or RENEW), with the read version as the
    precondition. The times are informational: no replica decides on them."""
    stamp = micro_time(now)
    spec: dict[str, Any] = {
        "holderIdentity": identity,
        "leaseDurationSeconds": timing.lease_duration,
        "renewTime": stamp,
    }
    if action is Action.RENEW and record is not None:
        spec["acquireTime"] = record.acquire_time or stamp
        spec["leaseTransitions"] = record.transitions
    elif action is Action.TAKE and record is not None:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = record.transitions + 1
    elif action is Action.CREATE:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = 0
    else:
        raise ValueError(f"nothing to write for {action} of {record}")
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if record is not None and action is not Action.CREATE:
        metadata["resourceVersion"] = record.version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": spec}  # fmt: skip


def released_body(record: Record, now: dt.datetime, *, name: str, namespace: str
                  ) -> dict[str, Any]:  # fmt: skip
    """The Lease given up by its holder on a clean stop: no holder (a standby takes it at its
    next try, without waiting for expiry), as client-go's ``ReleaseOnCancel`` writes it."""
    stamp = micro_time(now)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": record.version},
        "spec": {
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "leaseTransitions": record.transitions,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }
