"""Leader election on a Lease: the pure decisions (kvbridge_operator.lease) and the elector's
loop (kvbridge_operator.leader) against an in-memory Lease with the API server's optimistic
concurrency, on a fake clock where timing matters."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from typing import Any

import pytest

from kvbridge_operator import lease
from kvbridge_operator.config import Settings
from kvbridge_operator.leader import LeaderElector
from kvbridge_operator.lease import Action, Observation, Record, Term, Timing

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
T = Timing()  # 15 / 10 / 2


def rec(holder: str, version: str = "1", duration: int = 15, transitions: int = 0) -> Record:
    return Record(holder=holder, duration=duration, transitions=transitions, version=version)


# -- decisions --------------------------------------------------------------------------------

def test_no_lease_is_created_an_own_one_renewed() -> None:
    assert lease.decide(Observation(None, 0.0), "a", 0.0) is Action.CREATE
    assert lease.decide(Observation(rec("a"), 0.0), "a", 100.0) is Action.RENEW


def test_another_holder_is_waited_for_until_its_lease_expires_on_our_clock() -> None:
    obs = Observation(rec("b"), at=50.0)
    assert lease.decide(obs, "a", 50.0) is Action.WAIT
    assert lease.decide(obs, "a", 64.9) is Action.WAIT
    assert lease.decide(obs, "a", 65.0) is Action.TAKE
    # The record's own duration counts (the holder's setting), not ours.
    assert lease.decide(Observation(rec("b", duration=60), 50.0), "a", 65.0) is Action.WAIT


def test_a_released_lease_is_taken_at_once() -> None:
    assert lease.decide(Observation(rec("", duration=1), at=50.0), "a", 50.0) is Action.TAKE


def test_expiry_counts_from_when_the_current_version_was_first_seen() -> None:
    first = lease.observe(None, rec("b", "7"), now=10.0)
    assert lease.observe(first, rec("b", "7"), now=20.0) is first  # unchanged: same clock
    renewed = lease.observe(first, rec("b", "8"), now=21.0)
    assert renewed.at == 21.0
    assert lease.observe(Observation(None, 3.0), None, 9.0).at == 3.0
    assert lease.observe(Observation(None, 3.0), rec("b"), 9.0).at == 9.0


def test_a_standby_tries_again_at_expiry_not_a_retry_period_later() -> None:
    obs = Observation(rec("b"), at=0.0)
    assert lease.next_try_in(obs, "a", 5.0, T) == T.retry_period
    assert lease.next_try_in(obs, "a", 14.5, T) == pytest.approx(0.5)
    assert lease.next_try_in(obs, "a", 20.0, T) == 0.0
    assert lease.next_try_in(Observation(rec("a"), 0.0), "a", 14.5, T) == T.retry_period
    assert lease.next_try_in(None, "a", 0.0, T) == T.retry_period


def test_written_leases_count_transitions_and_carry_the_read_version() -> None:
    body = lease.lease_body(Action.CREATE, None, "a", T, NOW, name="l", namespace="ns")
    assert body["spec"]["holderIdentity"] == "a" and body["spec"]["leaseTransitions"] == 0
    assert body["spec"]["leaseDurationSeconds"] == 15
    assert body["spec"]["renewTime"] == "2025-01-01T00:00:00.000000Z"
    assert "resourceVersion" not in body["metadata"]
    old = Record("b", 15, transitions=3, acquire_time="x", version="42")
    taken = lease.lease_body(Action.TAKE, old, "a", T, NOW, name="l", namespace="ns")
    assert taken["spec"]["leaseTransitions"] == 4
    assert taken["metadata"]["resourceVersion"] == "42"
    mine = Record("a", 15, transitions=4, acquire_time="then", version="43")
    renewed = lease.lease_body(Action.RENEW, mine, "a", T, NOW, name="l", namespace="ns")
    assert renewed["spec"]["acquireTime"] == "then" and renewed["spec"]["leaseTransitions"] == 4
    released = lease.released_body(mine, NOW, name="l", namespace="ns")
    assert released["spec"]["holderIdentity"] == "" and released["metadata"]["resourceVersion"]
    assert Record.from_lease(released).holder == ""
    with pytest.raises(ValueError, match="nothing to write"):
        lease.lease_body(Action.WAIT, old, "a", T, NOW, name="l", namespace="ns")


def test_a_term_ends_at_the_renew_deadline_for_good() -> None:
    term = Term(renew_deadline=10.0)
    assert not term.leading(0.0)
    assert term.renewed(attempt_started=0.0)
    assert term.leading(9.9) and not term.leading(10.0)
    assert not term.renewed(attempt_started=9.0)  # lapsed meanwhile: no way back
    assert not term.leading(9.5)
    late = Term(renew_deadline=10.0)
    late.renewed(0.0)
    assert not late.renewed(attempt_started=10.5)  # started after the deadline
    assert late.lapsed


@pytest.mark.parametrize(("timing", "message"), [
    ({"lease_duration": 10, "renew_deadline": 10.0}, "lease duration"),
    ({"renew_deadline": 2.0, "retry_period": 2.0}, "renew deadline"),
    ({"retry_period": 0.0}, "retry period"),
    ({"lease_duration": 15.5}, "whole seconds"),
])  # fmt: skip
def test_inconsistent_timings_are_refused(timing: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Timing(**timing)


def test_settings_refuse_inconsistent_timings_only_with_election_on() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        Settings(renew_deadline=20.0)
    Settings(leader_election=False, renew_deadline=20.0)


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "kvbridge-7d9f-x2")
    monkeypatch.setenv("POD_NAMESPACE", "kvbridge-system")
    monkeypatch.setenv("KVBRIDGE_LEASE_DURATION", "30")
    monkeypatch.setenv("KVBRIDGE_LEASE_RENEW_DEADLINE", "20")
    monkeypatch.setenv("KVBRIDGE_LEASE_RETRY_PERIOD", "4")
    s = Settings.from_env()
    assert (s.identity, s.lease_namespace, s.lease_name) == (
        "kvbridge-7d9f-x2", "kvbridge-system", "kvbridge-operator")
    assert s.timing == Timing(30, 20.0, 4.0) and s.leader_election
    monkeypatch.setenv("KVBRIDGE_LEASE_NAMESPACE", "ops")
    monkeypatch.setenv("KVBRIDGE_LEADER_ELECTION", "false")
    assert Settings.from_env().lease_namespace == "ops"
    assert not Settings.from_env().leader_election
    monkeypatch.setenv("KVBRIDGE_LEADER_ELECTION", "maybe")
    with pytest.raises(ValueError, match="KVBRIDGE_LEADER_ELECTION"):
        Settings.from_env()
    monkeypatch.delenv("KVBRIDGE_LEADER_ELECTION")
    monkeypatch.delenv("POD_NAME")
    assert Settings.from_env().identity != Settings.from_env().identity  # unique per process


# -- the elector against an in-memory Lease ---------------------------------------------------

class Conflict(Exception):
    pass


class MemoryLease:
    """One Lease with the API server's rules: create fails if it exists, replace fails unless
    the body carries the current resourceVersion (both 409, which the elector sees as None)."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.writes: list[str] = []

    def read(self) -> Record | None:
        if self.down:
            raise ConnectionError("API server down")
        return Record.from_lease(self.obj) if self.obj else None

    def write(self, body: dict[str, Any], create: bool) -> Record | None:
        if self.down:
            raise ConnectionError("API server down")
        if create and self.obj is not None:
            return None
        if not create and (self.obj is None or body["metadata"].get("resourceVersion")
                           != self.obj["metadata"]["resourceVersion"]):  # fmt: skip
            return None
        self.version += 1
        self.obj = copy.deepcopy(body)
        self.obj["metadata"]["resourceVersion"] = str(self.version)
        self.writes.append(body["spec"]["holderIdentity"])
        return Record.from_lease(self.obj)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class MemoryElector(LeaderElector):
    def __init__(self, store: MemoryLease, identity: str, clock: Any = None,
                 timing: Timing = T) -> None:  # fmt: skip
        kw = {"clock": clock} if clock is not None else {}
        super().__init__(None, namespace="ns", name="kvbridge-operator", identity=identity,
                         timing=timing, **kw)  # fmt: skip
        self.store = store

    async def _read(self) -> Record | None:
        return self.store.read()

    async def _write(self, body: dict[str, Any], *, create: bool) -> Record | None:
        return self.store.write(body, create)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_one_leads_the_other_stands_by() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = MemoryElector(store, "a", clock), MemoryElector(store, "b", clock)
    assert run(a.try_acquire_or_renew()) and a.leading()
    assert not run(b.try_acquire_or_renew()) and not b.leading()
    clock.now += 2
    assert run(a.try_acquire_or_renew())
    assert not run(b.try_acquire_or_renew())
    assert store.writes == ["a", "a"]


def test_a_dead_leader_stops_acting_before_the_standby_takes_over() -> None:
    """The leader renews, then dies between two renewals (its process gone, or frozen): at
    no instant do both replicas consider themselves leading, and the standby leads no later
    than a lease duration plus a retry period after the last renewal."""
    store, clock = MemoryLease(), Clock()
    a, b = MemoryElector(store, "a", clock), MemoryElector(store, "b", clock)
    run(a.try_acquire_or_renew())
    run(b.try_acquire_or_renew())
    last_renewal = clock.now
    taken_at = None
    while taken_at is None:
        clock.now += b._pause(clock.now) or 0.01
        assert not (a.leading() and b.leading()), clock.now
        if run(b.try_acquire_or_renew()):
            taken_at = clock.now
        assert not (a.leading() and b.leading()), clock.now
    assert not a.leading()
    expires = last_renewal + T.lease_duration
    assert expires <= taken_at <= expires + T.retry_period
    assert Record.from_lease(store.obj).transitions == 1  # type: ignore[arg-type]
    # The old leader, alive again, finds the Lease taken: it never leads again in this process.
    assert not run(a.try_acquire_or_renew()) and not a.leading()


def test_a_leader_that_cannot_renew_lapses_at_the_renew_deadline_and_stays_out() -> None:
    store, clock = MemoryLease(), Clock()
    a = MemoryElector(store, "a", clock)
    run(a.try_acquire_or_renew())
    store.down = True
    clock.now += T.renew_deadline - 0.1
    assert a.leading()
    clock.now += 0.1
    assert not a.leading()
    store.down = False  # the API server is back and the Lease still names a ...
    assert not run(a.try_acquire_or_renew()) and not a.leading()  # ... but its term is over
    assert store.writes == ["a"]


def test_two_standbys_taking_an_expired_lease_at_once_one_wins() -> None:
    store, clock = MemoryLease(), Clock()
    old, b, c = (MemoryElector(store, n, clock) for n in ("old", "b", "c"))
    run(old.try_acquire_or_renew())
    for e in (b, c):
        run(e.try_acquire_or_renew())
    clock.now += T.lease_duration
    record = store.read()
    # Both read the expired Lease before either writes: the second write carries a stale
    # resourceVersion and loses.
    bodies = [lease.lease_body(Action.TAKE, record, e.identity, T, NOW, name="l", namespace="ns")
              for e in (b, c)]  # fmt: skip
    assert store.write(bodies[0], create=False) is not None
    assert store.write(bodies[1], create=False) is None
    assert store.read().holder == "b"  # type: ignore[union-attr]


def test_release_hands_over_at_the_next_try_and_stops_acting_first() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = MemoryElector(store, "a", clock), MemoryElector(store, "b", clock)
    run(a.try_acquire_or_renew())
    run(b.try_acquire_or_renew())
    run(a.release())
    assert not a.leading()
    assert run(b.try_acquire_or_renew()) and b.leading()  # no waiting for expiry
    run(a.release())  # a second release, or one by a non-holder, writes nothing
    assert store.writes == ["a", "", "b"]


def test_release_by_a_standby_writes_nothing() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = MemoryElector(store, "a", clock), MemoryElector(store, "b", clock)
    run(a.try_acquire_or_renew())
    run(b.try_acquire_or_renew())
    run(b.release())
    assert store.writes == ["a"] and a.leading()


def test_the_loop_hands_over_in_real_time() -> None:
    """Both loops running (1 s lease, 0.5 s renew deadline, 0.1 s retry period): the first
    leads; cancelled without a release (SIGKILL), the standby leads within a lease duration
    plus a retry period; released (SIGTERM), within about a retry period."""
    timing = Timing(lease_duration=1, renew_deadline=0.5, retry_period=0.1)

    async def scenario(release: bool) -> float:
        store = MemoryLease()
        changes: list[tuple[str, bool, float]] = []
        loop = asyncio.get_running_loop()

        def recorder(name: str) -> Any:
            async def changed(leading: bool) -> None:
                changes.append((name, leading, loop.time()))
            return changed

        a, b = MemoryElector(store, "a", timing=timing), MemoryElector(store, "b", timing=timing)
        ta = asyncio.create_task(a.run(recorder("a")))
        await asyncio.sleep(0.3)
        tb = asyncio.create_task(b.run(recorder("b")))
        await asyncio.sleep(0.5)
        assert a.leading() and not b.leading()
        if release:
            await a.release()
        ta.cancel()
        stopped = loop.time()
        while not b.leading():
            await asyncio.sleep(0.01)
        took = loop.time() - stopped
        assert not a.leading()  # its term lapsed before b could take over
        tb.cancel()
        assert [(n, v) for n, v, _ in changes] == [("a", True), ("b", True)]
        return took

    assert run(scenario(release=False)) <= timing.lease_duration + timing.retry_period + 0.1
    assert run(scenario(release=True)) <= timing.retry_period + 0.1


def test_an_empty_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="identity"):
        MemoryElector(MemoryLease(), "")


# -- the write gate ---------------------------------------------------------------------------

class _StatusApi:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def patch_namespaced_custom_object_status(self, *args: Any) -> None:
        self.calls.append(args)


def test_status_writes_ask_the_lease_first() -> None:
    """Kube sends no status patch while ``may_write`` says no: NotLeading, nothing sent."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge_operator.kube import Kube, NotLeading

    kube = Kube.__new__(Kube)  # no kubeconfig: only the gate is exercised
    kube._api = api = _StatusApi()  # type: ignore[assignment]
    kube._pool = ThreadPoolExecutor(1)
    leading = False
    kube._may_write = lambda: leading
    try:
        with pytest.raises(NotLeading, match="kvendpoints/d0-0"):
            run(kube.patch_endpoint_status("serving", "d0-0", {"state": "Paired"}))
        assert api.calls == []
        leading = True
        assert run(kube.patch_endpoint_status("serving", "d0-0", {"state": "Paired"}))
        assert len(api.calls) == 1
    finally:
        kube.close()


def test_a_replica_losing_the_lease_leaves_the_release_to_the_next_leader(caplog) -> None:
    """The finalizer's release stops at the first refused write instead of retrying and then
    letting the finalizer go with the endpoints untold: kopf keeps the finalizer and the next
    leader releases."""
    from kvbridge_operator import reconciler
    from kvbridge_operator import testing as manifests
    from kvbridge_operator.kube import NotLeading
    from kvbridge_operator.spec import parse_endpoint

    class Lapsed:
        def __init__(self) -> None:
            self.tries = 0

        async def patch_endpoint_status(self, *args: Any, **kw: Any) -> bool:
            self.tries += 1
            raise NotLeading("not the operator's Lease holder")

    endpoints = [parse_endpoint(manifests.endpoint_manifest(n, role="decode", engine_id=n[:2],
                                                            namespace="serving"))
                 for n in ("d0-0", "d1-0")]  # fmt: skip
    kube = Lapsed()
    with pytest.raises(NotLeading):
        run(reconciler.release("serving", "kvt", endpoints, kube,  # type: ignore[arg-type]
                               retry_delays=(0.0, 0.0)))  # fmt: skip
    assert kube.tries == 1
    assert "releasing the finalizer anyway" not in caplog.text
