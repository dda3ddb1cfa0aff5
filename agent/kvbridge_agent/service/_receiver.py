"""The waiting side of the service: holds, leases and expected receipts (flow 5).

The side that waits for the other's completion notifications (prefill in pull mode, decode
in push mode, and ``kv_both``'s producer) keeps a :class:`~..nixl.CompletionTracker`. This
module drives it: what to hold or expect, what a waiter may still ask for, and the
notifications each poll hands it. All state is guarded by :attr:`Core.lock` (lock order:
``_core``); the tracker's release callback runs with it held and wakes waiters on
:attr:`Core.cond`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..nixl import HEARTBEAT_PREFIX  # no NIXL build loads here
from ._core import Core
from ._types import DECODE, Side, TransferResult, UnknownRequestError, WrongSideError

if TYPE_CHECKING:
    from ..nixl import CompletionTracker

__all__ = ["Receiver"]

_HEARTBEAT = HEARTBEAT_PREFIX.encode()


class Receiver:
    """Requests held for, or expected from, the other side."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._expected: dict[str, list[list[int]]] = {}   # decode, push: rid -> local ids
        self._released: dict[str, str] = {}               # rid -> ReleaseReason, for waiters
        #: completion notifications processed (heartbeats not counted)
        self.notifications_received = 0

    def tracker(self, what: str) -> CompletionTracker:
        """The tracker, when ``what`` is a call of the waiting side; else WrongSideError."""
        c = self._core
        if c.tracker is None:
            e = c.engine
            raise WrongSideError(
                f"agent {c.agent_name}: {what} is for the side that waits for completion "
                f"notifications (prefill in pull mode, decode in push mode), not a {e.role} "
                f"agent in {e.mode} mode")
        return c.tracker

    def hold(self, request_ids: Iterable[str], lease_s: float | None) -> None:
        with self._core.lock:
            tracker = self.tracker("hold")
            for rid in request_ids:
                tracker.register(rid, lease_s=lease_s)

    def unhold(self, request_ids: Iterable[str]) -> None:
        with self._core.lock:
            tracker = self.tracker("unhold")
            for rid in request_ids:
                tracker.forget(rid)

    def set_lease(self, request_id: str, lease_s: float) -> None:
        with self._core.lock:
            self.tracker("set_lease").set_lease(request_id, lease_s)

    def expect(self, request_id: str, local_block_ids: Sequence[Sequence[int]],
               lease_s: float | None) -> None:
        """See :meth:`AgentService.expect`."""
        from ..geometry import expand_logical_to_kernel

        c = self._core
        if c.side is not Side.RECEIVER or c.engine.role != DECODE:
            raise WrongSideError(f"agent {c.agent_name}: expect needs a decode agent in "
                                 "push mode")
        if c.local is None:
            raise c.closed()
        ids = [[int(b) for b in g] for g in local_block_ids]
        c.local.desc_layout(1, False).desc_ids(
            [expand_logical_to_kernel(g, c.engine.ppl) for g in ids])
        with c.lock:
            tracker = self.tracker("expect")
            self._released.pop(request_id, None)
            self._expected[request_id] = ids
            tracker.register(request_id, lease_s=lease_s)

    def wait_received(self, request_id: str, timeout: float,
                      poll_locked: Callable[[], None]) -> TransferResult:
        """See :meth:`AgentService.wait_received`; ``poll_locked`` advances the agent."""
        c = self._core
        deadline = time.monotonic() + timeout
        with c.lock:
            tracker = self.tracker("wait_received")
            if request_id not in self._expected:
                raise UnknownRequestError(
                    f"request {request_id!r} is not expected (see expect())")
            while request_id not in self._released:
                poll_locked()
                if request_id in self._released:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return TransferResult(
                        request_id, False, cause="timeout",
                        message=f"no completion notification within {timeout} s "
                                f"({tracker.received(request_id)} received)")
                c.cond.wait(timeout=min(left, 0.002))
            reason = self._released.pop(request_id)
            self._expected.pop(request_id, None)
        if reason == "completed":
            return TransferResult(request_id, True)
        return TransferResult(request_id, False, cause="expired",
                              message="the lease expired before the completion notification")

    def on_release(self, request_id: str, reason: str) -> None:
        """The tracker's callback (``Core.lock`` held): wake a waiter of ``request_id``."""
        if request_id in self._expected:   # only what a waiter may still ask for
            self._released[request_id] = reason
            self._core.cond.notify_all()

    def take_completions(self) -> dict[str, list[str]]:
        """Requests completed or expired since the last call (``Core.lock`` held)."""
        tracker = self._core.tracker
        assert tracker is not None
        finished = sorted(tracker.take_finished())
        expired = sorted(tracker.take_expired())
        for rid in (*finished, *expired):
            self._expected.pop(rid, None)
            self._released.pop(rid, None)
        return {"finished": finished, "expired": expired}

    def poll_locked(self) -> None:
        """Hand the tracker this poll's notifications and expire leases (``Core.lock`` held)."""
        c = self._core
        if c.tracker is None or c.agent is None:
            return
        notifs = c.agent.get_notifs()
        self.notifications_received += sum(
            1 for msgs in notifs.values() for m in msgs if not bytes(m).startswith(_HEARTBEAT))
        c.tracker.process(notifs)
        c.tracker.expire()
