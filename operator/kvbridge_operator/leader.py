"""Operator replicas: one acts, holding a Lease; the others stand by and serve the webhook.

Every replica runs kopf, so every replica serves the admission webhook (kopf's webhook server
does not depend on what follows). What a standby does not do is watch and handle objects:
:func:`install` wraps kopf's orchestrator so that a toggle of kopf's own "pause" set (the one
kopf's peering pauses an operator with) is on while this replica does not hold the Lease.
While paused kopf neither lists nor watches KVTransfers, KVEndpoints and nodes, runs no
handler and no daemon, and writes nothing, its own bookkeeping (finalizers, progress
annotations) included. When the replica acquires the Lease the toggle goes off and kopf lists
everything, fills its indexes and starts a planning daemon per KVTransfer: the new leader plans
from what the API server stores, never from what the old leader had in memory.

Losing the Lease is final for a process: :class:`LeaderElector` closes the write gate at the
renew deadline (:class:`~.lease.Term`; every status write checks it, see ``Kube``), kopf is
paused again and the process stops with SIGTERM, as kube-controller-manager exits when it
loses its lease; Kubernetes restarts the container, which comes back as a standby with nothing
in memory from its term. A clean stop (SIGTERM, a rolling update) closes the gate, then
releases the Lease (empty holder), so a standby takes over at its next try instead of waiting
for expiry.

Peering (kopf's own) is off: a replica killed without a clean exit left its peering entry
behind, and its replacement paused until that entry expired (about a minute).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kopf._core.reactor import orchestration
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import lease, metrics
from .lease import Action, Observation, Record, Term, Timing

log = logging.getLogger("kvbridge.operator")

OnChange = Callable[[bool], Awaitable[None]]


class LeaderElector:
    """The Lease loop of one replica (see the module docstring and :mod:`.lease`)."""

    def __init__(self, api_client: Any, *, namespace: str, name: str, identity: str,
                 timing: Timing, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not identity:
            raise ValueError("leader election needs a non-empty identity (POD_NAME)")
        self.namespace, self.name, self.identity, self.timing = namespace, name, identity, timing
        self._clock = clock
        self._api = client.CoordinationV1Api(api_client) if api_client is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-lease")
        self._obs: Observation | None = None
        self._term = Term(timing.renew_deadline)
        self._stopped = False
        self._failures = 0

    def leading(self) -> bool:
        """Whether this replica may write now (checked before every status write)."""
        return not self._stopped and self._term.leading(self._clock())

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def run(self, on_change: OnChange) -> None:
        """Try to acquire, then renew, until the term lapses (returns after
        ``on_change(False)``) or the task is cancelled. ``on_change(True)`` when it leads."""
        metrics.LEADER.set(0)
        led = False
        while not self._stopped:
            try:
                await self.try_acquire_or_renew()
                self._failures = 0
            except Exception as exc:  # the API server did not answer, or refused: try again
                self._failures += 1
                level = logging.WARNING if self._failures in (1, 10) or led else logging.DEBUG
                log.log(level, "Lease %s: acquire/renew failed (%s)", self.lease, exc)
            leading = self.leading()
            if leading and not led:
                led = True
                metrics.LEADER.set(1)
                metrics.LEADER_TRANSITIONS.labels("acquired").inc()
                log.info("Lease %s acquired by %s: leading", self.lease, self.identity)
                await on_change(True)
            elif led and not leading:
                metrics.LEADER.set(0)
                if not self._stopped:
                    metrics.LEADER_TRANSITIONS.labels("lost").inc()
                    log.error("Lease %s: not renewed within %.1f s; %s stops acting",
                              self.lease, self.timing.renew_deadline, self.identity)  # fmt: skip
                await on_change(False)
                return
            await asyncio.sleep(self._pause(self._clock()))

    def _pause(self, now: float) -> float:
        pause = lease.next_try_in(self._obs, self.identity, now, self.timing)
        deadline = self._term.deadline()
        if deadline is not None and not self._term.lapsed:
            pause = min(pause, max(0.0, deadline - now) + 0.01)  # notice the lapse promptly
        return pause

    async def try_acquire_or_renew(self) -> bool:
        """One try: read the Lease, write it if it is ours to take or renew. True when this
        replica holds it afterwards."""
        started = self._clock()
        record = await self._read()
        self._obs = lease.observe(self._obs, record, self._clock())
        action = lease.decide(self._obs, self.identity, self._clock())
        if action is Action.WAIT or self._stopped or self._term.lapsed:
            return False
        body = lease.lease_body(action, record, self.identity, self.timing,
                                dt.datetime.now(dt.UTC), name=self.name,
                                namespace=self.namespace)  # fmt: skip
        written = await self._write(body, create=action is Action.CREATE)
        if written is None:
            return False  # another replica wrote first (409): read again next time
        self._obs = Observation(written, self._clock())
        if action is Action.TAKE and record is not None and record.holder:
            log.info("Lease %s: %s had not renewed it for %d s; taking over", self.lease,
                     record.holder, record.duration)  # fmt: skip
        return self._term.renewed(started)

    async def release(self) -> None:
        """Stop acting, then give the Lease up if this replica holds it (a clean stop)."""
        was_leading = self.leading()
        self._stopped = True
        metrics.LEADER.set(0)
        if not was_leading or self._obs is None or self._obs.record is None:
            return
        body = lease.released_body(self._obs.record, dt.datetime.now(dt.UTC), name=self.name,
                                   namespace=self.namespace)  # fmt: skip
        try:
            if await self._write(body, create=False) is not None:
                metrics.LEADER_TRANSITIONS.labels("released").inc()
                log.info("Lease %s released by %s", self.lease, self.identity)
        except Exception as exc:  # it expires instead
            log.warning("Lease %s: release failed (%s); it expires in %d s", self.lease, exc,
                        self.timing.lease_duration)  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- I/O ---------------------------------------------------------------------------------
    async def _call(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, _preload_content=False,
                                 _request_timeout=self.timing.renew_deadline / 2)  # fmt: skip
        response = await loop.run_in_executor(self._pool, call)
        return json.loads(response.data)

    async def _read(self) -> Record | None:
        try:
            found = await self._call(self._api.read_namespaced_lease, self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404 and _is_status(exc):
                return None
            raise
        return Record.from_lease(found)

    async def _write(self, body: dict[str, Any], *, create: bool) -> Record | None:
        """Create or replace (with the read version as precondition); None on 409."""
        try:
            if create:
                written = await self._call(self._api.create_namespaced_lease, self.namespace,
                                           body)  # fmt: skip
            else:
                written = await self._call(self._api.replace_namespaced_lease, self.name,
                                           self.namespace, body)  # fmt: skip
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return Record.from_lease(written)


def _is_status(exc: ApiException) -> bool:
    """A 404 that is a Kubernetes Status (the Lease is not there), not a starting API
    server's plain "404 page not found"."""
    try:
        return json.loads(exc.body or "").get("kind") == "Status"
    except (ValueError, AttributeError):
        return False


# -- kopf ---------------------------------------------------------------------------------------

_kopf_orchestrator = orchestration.orchestrator
_elector: LeaderElector | None = None


def install() -> None:
    """Route kopf's orchestrator through :func:`orchestrator` (idempotent). At import: kopf
    creates the orchestrator's coroutine before the startup handlers run (its body runs
    after them)."""
    orchestration.orchestrator = orchestrator


def use(elector: LeaderElector | None) -> None:
    """Run kopf paused until ``elector`` holds the Lease (None: always act). Called by the
    startup handler, which kopf runs before the orchestrator's body."""
    global _elector
    _elector = elector


async def orchestrator(**kwargs: Any) -> Any:
    """kopf's orchestrator (the watchers of every resource), paused while standing by."""
    elector = _elector
    if elector is None:
        return await _kopf_orchestrator(**kwargs)
    standby = await kwargs["operator_paused"].make_toggle(
        True, name=f"standing by: Lease {elector.lease} is not held by {elector.identity}")

    async def changed(leading: bool) -> None:
        await standby.turn_to(not leading)
        if not leading:
            os.kill(os.getpid(), signal.SIGTERM)  # restart as a standby, with nothing in memory

    log.info("Standing by until %s holds Lease %s", elector.identity, elector.lease)
    loop = asyncio.create_task(elector.run(changed), name="kvbridge leader election")
    loop.add_done_callback(_stop_if_failed)
    try:
        return await _kopf_orchestrator(**kwargs)
    finally:
        loop.cancel()
        await asyncio.shield(elector.release())


def _stop_if_failed(task: asyncio.Task[None]) -> None:
    """The Lease loop must not die quietly (kopf would stay paused, or act with no one
    renewing): stop the process, which Kubernetes restarts."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the Lease loop failed; stopping", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)
