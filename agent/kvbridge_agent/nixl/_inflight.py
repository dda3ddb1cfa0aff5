"""Book-keeping of in-flight transfer requests: parts, deadlines, deferred notifications.

State machine per request (``RequestState``):

    IN_PROGRESS --all parts DONE--> notifications sent --> on_success (zeroing) --> DONE
    IN_PROGRESS --exception / deadline--> FAILED (handles released, notifications dropped)

A failed request is reported only once every one of its handles has been released: a
handle whose release raises is *held* and retried on every poll, because its DMA may still
be running into blocks the caller would otherwise reuse (spec §4.8). Nothing here sleeps
except :meth:`Transfers.wait`, which spins on polls until its deadline.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ._agent import NixlAgent, XferHandle, XferState
from ._errors import FailureCause, NixlCallError, TransferFailure, classify

log = logging.getLogger(__name__)

__all__ = ["RequestState", "TransferDone", "Transfers"]


class RequestState(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class TransferDone(NamedTuple):
    """A request whose every part finished and whose notifications were sent (a NamedTuple,
    like ``PullRequest``: one per request, cheap to build).

    ``notify_failures`` counts notifications NIXL refused (the peer then frees on lease
    expiry, spec §4.5). ``zeroed_bytes``: local bytes the request owned but did not read,
    zeroed after the read (spec §4.9).
    """

    request_id: str
    nbytes: int
    parts: int
    descs: int
    notified: tuple[str, ...] = ()
    notify_failures: int = 0
    zeroed_bytes: int = 0


@dataclass(eq=False, slots=True)
class _Request:
    request_id: str
    deadline: float
    inflight: list[XferHandle] = field(default_factory=list)
    held: list[XferHandle] = field(default_factory=list)
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    attached: list[str] = field(default_factory=list)   # peers notified by a part itself
    failure: TransferFailure | None = None
    nbytes: int = 0
    parts: int = 0
    descs: int = 0
    sealed: bool = False   # all parts posted; may complete once inflight is empty
    on_success: Callable[[], int] | None = None   # post-processing on success (zeroing)
    result: TransferDone | TransferFailure | None = None   # terminal, not yet reported


Result = TransferDone | TransferFailure

#: Polls :meth:`Transfers.wait` makes back to back before it starts sleeping between polls.
SPIN_POLLS = 2000


class Transfers:
    """The in-flight requests of one engine, over one :class:`NixlAgent`."""

    def __init__(self, agent: NixlAgent, *, clock: Callable[[], float] = time.monotonic,
                 on_terminal: Callable[[str], None] | None = None) -> None:
        self.agent = agent
        self._clock = clock
        self._reqs: dict[str, _Request] = {}
        self._on_terminal = on_terminal

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def active(self) -> tuple[str, ...]:
        return tuple(self._reqs)

    def state(self, request_id: str) -> RequestState:
        req = self._reqs[request_id]
        return RequestState.FAILED if req.failure else RequestState.IN_PROGRESS

    # -- building a request ---------------------------------------------------------------
    def begin(self, request_id: str, deadline: float) -> _Request:
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already in flight")
        req = _Request(request_id, deadline)
        self._reqs[request_id] = req
        return req

    def post(self, req: _Request, x: XferHandle, notif: bytes = b"", *,
             attached: bool = False) -> None:
        """Post one part. Raises NixlCallError (the caller fails the request); the handle is
        then tracked, so failing the request releases it. ``notif`` rides on this part: NIXL
        delivers it to the part's peer only once the part completed (a request of exactly
        one part needs no deferred notification)."""
        if notif:
            req.attached.append(x.peer)
        req.parts += 1
        req.descs += x.num_descs
        req.nbytes += x.nbytes
        try:
            done = self.agent.post(x, b"" if attached else notif) is XferState.DONE
        except BaseException:
            req.inflight.append(x)     # tracked, so failing the request releases it
            raise
        if done:                       # with CMA the copy happened inside the post
            self._release_or_hold(req, x)
        else:
            req.inflight.append(x)

    def defer_notif(self, req: _Request, peer: str, message: bytes) -> None:
        req.notifs.append((peer, message))

    def set_on_success(self, req: _Request, fn: Callable[[], int]) -> None:
        """Run ``fn`` once the request has succeeded (every part DONE, notifications sent),
        before it is reported; it returns the bytes it zeroed. Never run after a failure.
        If it raises, the request is reported failed (ZEROING); the producer has already
        been told, which is right: its blocks were read completely."""
        req.on_success = fn

    def seal(self, req: _Request) -> None:
        """Every part has been posted: the request may now complete, and does at once when
        every part already finished inside its post (with CMA the copy happens there), so
        the next poll or wait only reports it."""
        req.sealed = True
        if req.failure is None and not req.inflight and not req.held:
            req.result = self._complete(req)

    def fail(self, req: _Request, cause: FailureCause, message: str,
             error: BaseException | None = None) -> None:
        """Mark failed (first failure wins), drop notifications, release every handle."""
        if req.failure is None:
            req.failure = TransferFailure(req.request_id, cause, message, error)
            log.warning("transfer %s failed (%s): %s", req.request_id, cause.value, message)
        req.notifs.clear()
        req.sealed = True
        for x in req.inflight:
            self._release_or_hold(req, x)
        req.inflight.clear()

    def fail_exc(self, req: _Request, exc: BaseException, default: FailureCause,
                 where: str) -> None:
        self.fail(req, classify(exc, default=default), f"{where}: {exc}", exc)

    def _release_or_hold(self, req: _Request, x: XferHandle) -> None:
        try:
            self.agent.release(x)
        except NixlCallError as exc:
            log.error("transfer %s: releasing %s failed, keeping it (its blocks stay pinned):"
                      " %s", req.request_id, x.label, exc)
            req.held.append(x)

    def _finish_part(self, req: _Request, x: XferHandle) -> None:
        req.inflight.remove(x)
        self._release_or_hold(req, x)

    # -- progress -------------------------------------------------------------------------
    def _step(self, req: _Request, now: float) -> Result | None:
        if req.result is not None:
            return req.result
        if req.failure is None:
            for x in list(req.inflight):
                try:
                    done = self.agent.state(x) is XferState.DONE
                except NixlCallError as exc:
                    self.fail(req, exc.cause, f"polling {x.label}: {exc}", exc)
                    break
                if done:
                    self._finish_part(req, x)
            if req.failure is None and req.inflight and now > req.deadline:
                self.fail(req, FailureCause.TIMEOUT,
                          f"{len(req.inflight)} part(s) still in flight at the deadline "
                          f"({', '.join(x.label for x in req.inflight)})")
        if req.failure is not None:
            for x in list(req.held):
                try:
                    self.agent.release(x)
                    req.held.remove(x)
                except NixlCallError:
                    pass
            return req.failure if not req.held else None
        if req.inflight or req.held or not req.sealed:
            return None
        return self._complete(req)

    def _complete(self, req: _Request) -> Result:
        # Notifications first: they only concern the producer's blocks, which every DONE
        # part has finished reading, so it may free them now rather than after our local
        # zeroing; and a zeroing error must not strand them until the lease expires.
        notified, failures = self._send_deferred(req) if req.notifs else (req.attached, 0)
        zeroed = 0
        if req.on_success is not None:
            try:
                zeroed = int(req.on_success())
            except Exception as exc:
                req.failure = TransferFailure(
                    req.request_id, FailureCause.ZEROING,
                    f"zeroing the pages the read did not cover: {exc}", exc)
                log.error("transfer %s: read complete but %s", req.request_id,
                          req.failure.message)
                return req.failure
        return TransferDone(req.request_id, req.nbytes, req.parts, req.descs,
                            tuple(notified), failures, zeroed)

    def _send_deferred(self, req: _Request) -> tuple[list[str], int]:
        """Send the request's deferred notifications: (every peer notified, including those
        whose part carried it, and how many NIXL refused)."""
        notified = list(req.attached)
        failures = 0
        for peer, message in req.notifs:
            try:
                self.agent.send_notif(peer, message)
                notified.append(peer)
            except NixlCallError as exc:
                failures += 1
                log.warning("transfer %s: notification to %s failed (it will free on lease "
                            "expiry): %s", req.request_id, peer, exc)
        req.notifs.clear()
        return notified, failures

    def _pop(self, req: _Request) -> None:
        self._reqs.pop(req.request_id, None)
        if self._on_terminal is not None:
            self._on_terminal(req.request_id)

    def poll(self) -> list[Result]:
        """Advance every request once; returns the ones that became terminal (each once)."""
        now = self._clock()
        out: list[Result] = []
        for req in list(self._reqs.values()):
            res = self._step(req, now)
            if res is not None:
                self._pop(req)
                out.append(res)
        return out

    def wait(self, request_id: str, deadline: float) -> Result:
        """Poll one request until terminal. At ``deadline`` a still-running request fails
        with TIMEOUT. Raises KeyError for an unknown (or already reported) request, and
        TimeoutError if it cannot be reported because a handle refuses to be released."""
        req = self._reqs[request_id]
        req.deadline = min(req.deadline, deadline)
        polls = 0
        while True:
            now = self._clock()
            res = self._step(req, now)
            if res is not None:
                self._pop(req)
                return res
            if now > deadline + 1.0:
                raise TimeoutError(
                    f"request {request_id!r} failed but {len(req.held)} handle(s) cannot be "
                    "released yet; poll() again later"
                )
            polls += 1
            # Spin first: a poll costs microseconds, while a sleep on a loaded machine can
            # oversleep by milliseconds. Then back off so a stuck peer does not burn a core.
            if polls > SPIN_POLLS:
                time.sleep(0.0002 if polls < SPIN_POLLS + 50 else 0.001)

    def close(self) -> None:
        for req in list(self._reqs.values()):
            self.fail(req, FailureCause.CANCELLED, "engine closed")
            self._pop(req)
