"""Runs plans: one long-lived loop per KVTransfer, woken by endpoint and transfer events.

State machine per KVTransfer (one asyncio task, the kopf daemon):

    plan + write  ->  wait (woken by ``wake()`` or the resync interval)  ->  debounce  -> ...

:meth:`PlanningLoops.wake` is called from kopf event handlers on the same event loop; it only
sets an ``asyncio.Event``. The loop reads the endpoints from kopf's in-memory index (fed by
the same watch stream), so a burst of changes is coalesced into one plan. Writes are merge
patches sent only when the computed status differs from what is stored (or was last written and not
yet seen back), so a restarted operator, which recomputes the same plan, writes nothing.

Ghosts: when a watch expires (410 Gone) kopf lists again; the listing brings every object that
exists but says nothing of those deleted while the watch was down, and kopf's index keeps
them. So after every listing (:meth:`PlanningLoops.relisted`), at a loop's start and every
resync interval, the loop compares the index with the stored KVEndpoints
(:func:`find_ghosts`) and plans without the ones that are gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.resources import (
    CONDITION_FIELDS,
    ENDPOINT_KIND,
    STATUS,
    TRANSFER_KIND,
    TRANSFER_STATUS_FIELDS,
    ConditionStatus,
    ConditionType,
)

from . import metrics, planner, status
from .config import Settings
from .errors import OperatorError, SpecError
from .kube import Kube, KubeUnavailable, NotLeading
from .spec import Endpoint, parse_transfer

log = logging.getLogger("kvbridge.operator")

Emit = Callable[[str, str, str], None]  # (type, reason, message) -> posts a k8s Event
LoopKey = tuple[str, str]  # (namespace, KVTransfer name)


@dataclass
class WriteMemory:
    """What one loop wrote last, to skip rewrites before the watch echoes them back."""

    transfer: dict[str, Any] | None = None
    endpoints: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: UIDs of index entries that are no longer stored (see the module docstring).
    ghosts: set[str] = field(default_factory=set)
    #: listings seen and the monotonic time at the last ghost check (None: never checked).
    checked: tuple[int, float] | None = None

    def check_due(self, listings: int, resync: float) -> bool:
        """Whether to look for ghosts: never looked, kopf listed again since (``listings``
        is :attr:`PlanningLoops.listings`), or a resync interval passed."""
        if self.checked is None:
            return True
        seen, when = self.checked
        return seen != listings or time.monotonic() - when >= resync


@dataclass
class PlanningLoops:
    """The running planning loops: each KVTransfer's wake-up event and write memory. Part
    of the operator's :class:`~.runtime.Runtime`, so nothing here is process-global."""

    events: dict[LoopKey, asyncio.Event] = field(default_factory=dict)
    memories: dict[LoopKey, WriteMemory] = field(default_factory=dict)
    #: KVEndpoint listing events kopf delivered (see :meth:`relisted`)
    listings: int = 0

    def wake(self, namespace: str | None, transfer: str | None) -> None:
        """Ask the loop of KVTransfer ``namespace/transfer`` to re-plan soon (no-op if none)."""
        event = self.events.get((namespace or "", transfer or ""))
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        """Ask every loop to re-plan soon (e.g. a node's topology label changed)."""
        for event in self.events.values():
            event.set()

    def relisted(self) -> None:
        """kopf delivered a KVEndpoint from a listing (event type None: at startup, or after
        an expired watch): every loop looks for ghosts before its next plan."""
        self.listings += 1
        self.wake_all()

    def tracked(self) -> dict[str, int]:
        """Sizes of the bookkeeping: loops, and statuses remembered as written (one per live
        KVEndpoint and KVTransfer at most). Exported as ``kvbridge_tracked_objects`` so a
        test or a platform team can see they follow the objects, not the number of changes."""
        memories = list(self.memories.values())
        return {
            "planning_loops": len(self.events),
            "written_endpoint_statuses": sum(len(m.endpoints) for m in memories),
            "written_transfer_statuses": sum(m.transfer is not None for m in memories),
        }


@dataclass(frozen=True)
class Context:
    """What one KVTransfer's loop plans and how it writes: the target, the writer, the
    settings, where Events go and what it wrote last."""

    namespace: str
    name: str
    kube: Kube
    settings: Settings
    emit: Emit
    memory: WriteMemory = field(default_factory=WriteMemory)


async def run(
    ctx: Context,
    loops: PlanningLoops,
    *,
    body: Mapping[str, Any],
    endpoints: Callable[[], Iterable[Endpoint]],
    nodes: Callable[[], Mapping[str, Mapping[str, str]]],
    stopped: Any,
    lost: Callable[[], frozenset[str]] = frozenset,
) -> None:
    """The per-KVTransfer loop, registered in ``loops`` while it runs; returns when
    ``stopped`` (kopf's daemon flag) is set."""
    key = (ctx.namespace, ctx.name)
    event = loops.events[key] = asyncio.Event()
    memory = loops.memories[key] = ctx.memory
    settings = ctx.settings
    try:
        while not stopped:
            event.clear()
            try:
                current = list(endpoints())
                if memory.check_due(loops.listings, settings.resync):
                    memory.checked = (loops.listings, time.monotonic())
                    await _check_ghosts(ctx, current)
                current = [e for e in current if e.uid not in memory.ghosts]
                await reconcile(ctx, body, current, nodes(), lost())
            except NotLeading:
                # The Lease was lost: kopf stops this daemon as the process stops (see leader).
                await _until(stopped)
                return
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                log.exception("planning KVTransfer %s/%s failed; retrying", *key)
                await asyncio.sleep(1.0)
                continue
            await _wait_change(event, stopped, settings.resync)
            if event.is_set() and not stopped:
                await asyncio.sleep(settings.debounce)
    finally:
        if loops.events.get(key) is event:
            del loops.events[key]
        if loops.memories.get(key) is ctx.memory:
            del loops.memories[key]


async def find_ghosts(namespace: str, endpoints: Iterable[Endpoint], kube: Kube) -> set[str]:
    """UIDs of ``endpoints`` (kopf's index) that are no longer stored: one LIST of the
    namespace, then a GET of each endpoint missing from it (it may be newer than the LIST)."""
    endpoints = list(endpoints)
    if not endpoints:
        return set()
    stored = await kube.endpoint_uids(namespace)
    return {
        e.uid
        for e in endpoints
        if e.uid not in stored and await kube.endpoint_uid(namespace, e.name) != e.uid
    }


async def _check_ghosts(ctx: Context, endpoints: list[Endpoint]) -> None:
    namespace, name, kube, memory = ctx.namespace, ctx.name, ctx.kube, ctx.memory
    indexed = {e.uid for e in endpoints}
    memory.ghosts &= indexed  # kopf's index keeps a ghost as long as the operator runs
    new = await find_ghosts(namespace, (e for e in endpoints if e.uid not in memory.ghosts), kube)
    if new:
        names = sorted(e.name for e in endpoints if e.uid in new)
        log.warning(
            "KVTransfer %s/%s: KVEndpoint(s) %s were deleted while the watch was down "
            "(kopf's index still holds them); planning without them",
            namespace,
            name,
            ", ".join(names),
        )
        memory.ghosts |= new


async def _wait_change(event: asyncio.Event, stopped: Any, timeout: float) -> None:
    """Until ``event`` is set, kopf asks the daemon to stop, or ``timeout`` passes."""
    woken = asyncio.ensure_future(event.wait())
    stopping = asyncio.ensure_future(_until(stopped))
    try:
        await asyncio.wait({woken, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (woken, stopping):
            task.cancel()


async def _until(stopped: Any) -> None:
    await stopped.wait()


async def reconcile(
    ctx: Context,
    body: Mapping[str, Any],
    endpoints: list[Endpoint],
    nodes: Mapping[str, Mapping[str, str]],
    lost_nodes: frozenset[str] = frozenset(),
) -> planner.Plan | None:
    """Plan once and write what changed. Returns the plan (None for an invalid spec)."""
    namespace, name, kube, memory = ctx.namespace, ctx.name, ctx.kube, ctx.memory
    started = time.perf_counter()
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    stored = dict(body.get(STATUS) or {})
    old = memory.transfer if memory.transfer is not None else stored
    now = status.now_rfc3339()
    try:
        transfer = parse_transfer(body)
    except SpecError as exc:
        new = status.invalid_transfer_status(old, generation=generation, now=now, message=str(exc))
        await _write_transfer(ctx, stored, old, new)
        metrics.record_conditions(namespace, name, TRANSFER_STATUS_FIELDS.conditions.at(new))
        metrics.RECONCILES.labels("invalid").inc()
        return None
    plan = planner.plan(transfer, endpoints, nodes, lost_nodes)
    new = status.transfer_status(plan, old, generation=generation, now=now)
    by_name = {e.name: e for e in endpoints}
    semaphore = asyncio.Semaphore(ctx.settings.write_concurrency)

    async def write_endpoint(verdict: planner.EndpointPlan) -> None:
        e = by_name[verdict.name]
        desired = status.endpoint_status(verdict, e)
        if desired in (status.owned_part(e.status), memory.endpoints.get((e.name, e.uid))):
            return
        async with semaphore:
            if await kube.patch_endpoint_status(namespace, e.name, desired):
                metrics.STATUS_WRITES.labels(ENDPOINT_KIND).inc()
                memory.endpoints[(e.name, e.uid)] = desired

    await asyncio.gather(*(write_endpoint(v) for v in plan.endpoints))
    live = {(e.name, e.uid) for e in endpoints}
    for gone in set(memory.endpoints) - live:
        del memory.endpoints[gone]
    await _write_transfer(ctx, stored, old, new)
    metrics.record(namespace, name, plan)
    metrics.record_conditions(namespace, name, TRANSFER_STATUS_FIELDS.conditions.at(new))
    metrics.RECONCILES.labels("ok").inc()
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
    return plan


async def _write_transfer(
    ctx: Context, stored: dict[str, Any], old: dict[str, Any], new: dict[str, Any]
) -> None:
    memory = ctx.memory
    if new in (stored, memory.transfer):
        return
    if await ctx.kube.patch_transfer_status(ctx.namespace, ctx.name, _with_removals(stored, new)):
        metrics.STATUS_WRITES.labels(TRANSFER_KIND).inc()
        memory.transfer = new
        conditions = TRANSFER_STATUS_FIELDS.conditions
        f = CONDITION_FIELDS
        for c in status.transitions(conditions.get(old), conditions.get(new) or []):
            kind, state = f.type.at(c), f.status.at(c)
            good = (state == ConditionStatus.TRUE) != (kind == ConditionType.DEGRADED)
            ctx.emit(
                "Normal" if good else "Warning",
                f.reason.at(c),
                f"{kind}={state}: {f.message.at(c)}",
            )


def _with_removals(stored: Mapping[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Merge patch that also deletes keys present before but absent now (e.g. after InvalidSpec)."""
    patch = dict(new)
    for k in stored:
        if k not in new:
            patch[k] = None
    return patch


#: Attempts and pauses of the release writes before the finalizer is let go anyway.
RELEASE_RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)


class ReleaseDeferred(OperatorError):
    """The API server could not be reached to tell every endpoint of a deleted KVTransfer;
    the release should run again later. Keeping the finalizer meanwhile costs nothing: its
    removal needs the same API server."""


async def release(namespace: str, name: str, endpoints: Iterable[Endpoint], kube: Kube,
                  *, retry_delays: Iterable[float] = RELEASE_RETRY_DELAYS) -> int:  # fmt: skip
    """Withdraw the peers of every endpoint of a KVTransfer being deleted; returns writes.

    The endpoints become ``Orphaned`` with reason ``TransferDeleted`` (see :func:`orphan`).
    A write the API server refuses (RBAC, validation) is retried a few times and then logged,
    so a refusal never holds the KVTransfer's finalizer: such an endpoint is marked Orphaned by
    its next event. A write the API server did not answer at all is different: its KVTransfer
    may be gone before any event tells the endpoint (a watch that resumes after a restart
    does not replay the deletion), so after the same retries :class:`ReleaseDeferred` asks
    for the release to run again.

    Raises:
        ReleaseDeferred: some endpoint could not be told because the API server did not
            answer.
        NotLeading: this replica lost the Lease; the next leader releases.
    """
    writes = 0
    todo = list(endpoints)
    for delay in (*retry_delays, None):
        failed: list[tuple[Endpoint, Exception]] = []
        for e in todo:
            desired = status.orphaned_endpoint_status(e, deleted=True)
            if status.owned_part(e.status) == desired:
                continue
            try:
                written = await kube.patch_endpoint_status(namespace, e.name, desired)
            except NotLeading:
                raise  # the next leader releases (kopf keeps the finalizer)
            except Exception as exc:   # any failure: retried, then given up
                failed.append((e, exc))
                continue
            if written:
                metrics.STATUS_WRITES.labels(ENDPOINT_KIND).inc()
                writes += 1
        if not failed:
            break
        todo = [e for e, _ in failed]
        if delay is None:
            unanswered = [e.name for e, exc in failed if isinstance(exc, KubeUnavailable)]
            if unanswered:
                raise ReleaseDeferred(
                    f"KVTransfer {namespace}/{name} deleted, but the API server did not answer "
                    f"while telling KVEndpoint(s) {', '.join(unanswered)}; trying again")
            for e, exc in failed:
                log.warning("KVTransfer %s/%s deleted, but KVEndpoint %s could not be told "
                            "(%s); releasing the finalizer anyway", namespace, name, e.name, exc)
            break
        await asyncio.sleep(delay)
    metrics.forget(namespace, name)
    return writes


async def orphan(endpoint: Endpoint, kube: Kube, *, deleted: bool = False) -> bool:
    """Say on a KVEndpoint that its KVTransfer does not exist; True when written.

    Written once: nothing is sent while the stored status already says so (a kept
    ``TransferDeleted`` included). The patch carries the ``resourceVersion`` the decision was
    based on, so it loses (409, ignored) against a plan written meanwhile by the loop of a
    KVTransfer that has just appeared; that loop re-plans the endpoint when it appears.
    """
    if endpoint.deleting:
        return False
    if deleted:
        desired = status.orphaned_endpoint_status(endpoint, deleted=True)
    else:
        desired = status.orphaned_status_for(endpoint)
    if status.owned_part(endpoint.status) == desired:
        return False
    written = await kube.patch_endpoint_status(
        endpoint.namespace,
        endpoint.name,
        desired,
        resource_version=endpoint.resource_version or None,
    )
    if written:
        metrics.STATUS_WRITES.labels(ENDPOINT_KIND).inc()
    return written
