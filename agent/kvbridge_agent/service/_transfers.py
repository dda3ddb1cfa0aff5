"""The mover's side of the service: run pulls and pushes, collect their outcomes (flow 5).

All state is guarded by :attr:`Core.lock` (lock order: ``_core``); a blocking transfer
waits on :attr:`Core.cond`, which :meth:`Transfers.poll_locked` notifies.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .. import metrics
from ..nixl import PullRequest, PushRequest, TransferFailure  # no NIXL build loads here
from ._core import Core
from ._types import Side, TransferResult, WrongSideError

if TYPE_CHECKING:
    from ..nixl import PullEngine, PushEngine, TransferDone
    from ._peers import PeerSet

__all__ = ["Transfers"]

log = logging.getLogger("kvbridge.agent")


#: A blocked caller polls about this many times over the time its transfer has taken so far.
POLLS_PER_ELAPSED = 20
MIN_POLL_PAUSE_S, MAX_POLL_PAUSE_S = 50e-6, 2e-3


def poll_pause(elapsed_s: float) -> float:
    """How long a caller blocked on a transfer waits before polling again: a twentieth of the
    time the transfer has taken so far, between 50 us and 2 ms. Its completion is then seen
    within about 5% of its duration (a fixed 2 ms cost a TCP pull of ~9 ms about 10%), and
    each poll also drives the transport's progress in the caller's thread."""
    return min(max(elapsed_s / POLLS_PER_ELAPSED, MIN_POLL_PAUSE_S), MAX_POLL_PAUSE_S)


class Transfers:
    """Requests in flight on this agent's mover and the outcomes not yet handed out."""

    def __init__(self, core: Core, peers: PeerSet) -> None:
        self._core = core
        self._peers = peers
        self._results: dict[str, TransferDone | TransferFailure] = {}
        self._started: dict[str, float] = {}
        self._async: set[str] = set()                      # pulls started by start()

    def mover_for(self, what: str, side: Side) -> PullEngine | PushEngine:
        """This agent's mover, when ``what`` is a call of ``side``; else WrongSideError."""
        c = self._core
        if c.side is not side:
            need = "a decode agent in pull mode" if side is Side.PULLER else (
                "a prefill agent in push mode")
            raise WrongSideError(f"agent {c.agent_name}: {what} needs {need}; this agent "
                                 f"is a {c.side.value} ({c.engine.role}, "
                                 f"{c.engine.mode} mode)")
        if c.mover is None:
            raise c.closed()
        return c.mover

    def start(self, req: PullRequest) -> None:
        """Post a pull and return; its outcome comes from :meth:`take_results`."""
        with self._core.lock:
            mover = self.mover_for("start_pull", Side.PULLER)
            self._async.add(req.request_id)
            self._started[req.request_id] = time.perf_counter()
            mover.start(req)

    def take_results(self) -> list[TransferResult]:
        """Pulls posted by :meth:`start` that ended as of the last poll, each once."""
        out: list[TransferResult] = []
        if not self._results:      # the common step: nothing ended (a racy read only delays)
            return out
        with self._core.lock:
            for rid in [r for r in self._async if r in self._results]:
                self._async.discard(rid)
                seconds = time.perf_counter() - self._started.pop(rid, time.perf_counter())
                out.append(self._outcome(rid, self._results.pop(rid), seconds))
        return out

    def run(self, req: PullRequest | PushRequest, expected_epoch: int | None,
            timeout: float) -> TransferResult:
        """Post ``req`` and block until its outcome or the deadline."""
        request_id, remote_engine_id = req.request_id, req.remote_engine_id
        c = self._core
        with c.lock:
            engine = c.mover
            if engine is None:
                raise c.closed()
            if expected_epoch is not None and (
                    stale := self._peers.epochs_if_stale(remote_engine_id, expected_epoch)):
                return self.failed(request_id, "stale_peer",
                                   f"remote {remote_engine_id!r} is loaded at epoch {stale}, "
                                   f"request expects {expected_epoch}")
            started = time.perf_counter()
            engine.start(req)
            self._started[request_id] = started
            deadline = time.monotonic() + timeout + 5.0   # the engine's own deadline is first
            while request_id not in self._results:
                self.poll_locked()
                if request_id in self._results:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.failed(request_id, "timeout", "no result before the deadline")
                c.cond.wait(timeout=min(left, poll_pause(time.perf_counter() - started)))
            res = self._results.pop(request_id)
            seconds = time.perf_counter() - self._started.pop(request_id, started)
        return self._outcome(request_id, res, seconds)

    def poll_locked(self) -> None:
        """Collect the mover's ended requests (``Core.lock`` held) and wake their waiters."""
        mover = self._core.mover
        if mover is None:
            return
        res = mover.poll()
        for r in (*res.finished, *res.failed):
            self._results[r.request_id] = r
        if res.finished or res.failed:
            self._core.cond.notify_all()

    def _outcome(self, request_id: str, res: TransferDone | TransferFailure,
                 seconds: float) -> TransferResult:
        """An engine's ``TransferDone`` / ``TransferFailure`` as a counted ``TransferResult``."""
        if isinstance(res, TransferFailure):
            return self.failed(request_id, res.cause.value, res.message)
        metrics.TALLY.add(res.nbytes, res.descs, seconds)
        return TransferResult(request_id, True, res.nbytes, res.descs, res.parts, seconds)

    @staticmethod
    def failed(request_id: str, cause: str, message: str) -> TransferResult:
        metrics.TRANSFER_FAILURES.labels(cause).inc()
        log.warning("transfer %s failed (%s): %s", request_id, cause, message)
        return TransferResult(request_id, False, cause=cause, message=message)
