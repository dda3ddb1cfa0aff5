"""The metrics the chart's dashboard and alerts need: KVTransfer conditions, admission
refusals, the agent's info series, and labelled counters that exist before their first event."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest
from prometheus_client import REGISTRY

from kvbridge_agent import metrics as agent_metrics
from kvbridge_agent.nixl import FailureCause
from kvbridge_operator import main
from kvbridge_operator import metrics as operator_metrics


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_conditions_are_exported_and_forgotten() -> None:
    operator_metrics.record_conditions("ns-m", "kvt", [
        {"type": "Ready", "status": "True"}, {"type": "Degraded", "status": "False"},
        {"type": "Paired", "status": "Unknown"}, {"type": "SomethingElse", "status": "True"}])
    sample = "kvbridge_transfer_condition"
    assert _value(sample, namespace="ns-m", transfer="kvt", condition="Ready") == 1
    assert _value(sample, namespace="ns-m", transfer="kvt", condition="Degraded") == 0
    assert _value(sample, namespace="ns-m", transfer="kvt", condition="Paired") == 0
    assert _value(sample, namespace="ns-m", transfer="kvt", condition="SomethingElse") is None
    operator_metrics.forget("ns-m", "kvt")
    assert _value(sample, namespace="ns-m", transfer="kvt", condition="Ready") is None


def test_every_condition_the_planner_sets_is_exported() -> None:
    from kvbridge_operator.conditions import desired_conditions
    from kvbridge_operator.model import RoleCounts
    from kvbridge_operator.spec import parse_transfer
    from kvbridge_operator.testing import transfer_manifest

    transfer = parse_transfer(transfer_manifest("kvt"))
    conds = desired_conditions(transfer, [], [], [], RoleCounts(), RoleCounts(), [])
    assert {c.type for c in conds} == set(operator_metrics.CONDITIONS)


def test_refusals_start_at_zero_and_count_with_a_warning(caplog: pytest.LogCaptureFixture
                                                         ) -> None:  # fmt: skip
    name = "kvbridge_admission_refusals_total"
    for resource in ("kvendpoints", "kvtransfers"):
        for reason in operator_metrics.REFUSAL_REASONS:
            assert _value(name, resource=resource, reason=reason) is not None
    before = _value(name, resource="kvtransfers", reason="invalid_spec")
    body = {"metadata": {"namespace": "ns", "name": "bad"},
            "spec": {"protocolVersion": 10, "mode": "pull", "prefill": {"tensorParallelSize": 1},
                     "decode": {"tensorParallelSize": 1}}}
    with caplog.at_level(logging.INFO, "kvbridge.operator"), \
            pytest.raises(kopf.AdmissionError, match=r"spec\.protocolVersion"):
        main.validate_kvtransfer(body=kopf.Body(body), old=None)
    assert _value(name, resource="kvtransfers", reason="invalid_spec") == before + 1
    (rec,) = [r for r in caplog.records if "admission refused" in r.getMessage()]
    assert rec.levelno == logging.WARNING and rec.exc_info is None
    assert "kvtransfers ns/bad (invalid_spec): spec.protocolVersion" in rec.getMessage()
    main.validate_kvtransfer(body=kopf.Body({**body, "spec": {**body["spec"],
                                                              "protocolVersion": 11}}), old=None)
    assert _value(name, resource="kvtransfers", reason="invalid_spec") == before + 1


def test_reconcile_results_start_at_zero() -> None:
    for result in ("ok", "invalid", "error"):
        assert _value("kvbridge_reconciles_total", result=result) is not None


def test_agent_counters_start_with_every_result_and_cause() -> None:
    causes = {c.value for c in FailureCause} | {"stale_peer"}
    assert set(agent_metrics.FAILURE_CAUSES) == causes
    reg = agent_metrics.REGISTRY
    for cause in causes:
        assert reg.get_sample_value("kvbridge_agent_transfer_failures_total",
                                    {"cause": cause}) is not None
    for result in agent_metrics.HANDSHAKE_RESULTS:
        assert reg.get_sample_value("kvbridge_agent_handshakes_total",
                                    {"result": result}) is not None


def test_agent_info() -> None:
    labels = {"namespace": "ns", "transfer": "kvt", "role": "decode", "engine_id": "D"}
    agent_metrics.set_info(**labels)
    assert agent_metrics.value("kvbridge_agent_info", **labels) == 1
    agent_metrics.clear_info(**labels)
    agent_metrics.clear_info(**labels)   # twice: no error
    assert agent_metrics.REGISTRY.get_sample_value("kvbridge_agent_info", labels) is None


def test_kopfs_error_line_for_a_refusal_is_dropped() -> None:
    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1, msg, None, None)

    assert not main._drop_refusal_errors(
        record("Webhook 'validate-kvtransfer' failed permanently: spec.protocolVersion: ..."))
    assert main._drop_refusal_errors(record("Handler 'plan' failed permanently: boom"))


def test_tracked_objects_are_read_at_scrape_time() -> None:
    sizes = {"things": 1}
    operator_metrics.track(lambda: sizes)
    assert _value("kvbridge_tracked_objects", kind="things") == 1
    sizes["things"] = 3
    assert _value("kvbridge_tracked_objects", kind="things") == 3


class _Stopped:
    """kopf's DaemonStopped as the loop uses it: falsy until set, awaitable."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


class _Kube:
    """Stores every endpoint it is asked about (no ghosts) and accepts every write."""

    def __init__(self, uids: set[str]) -> None:
        self.uids = uids

    async def endpoint_uids(self, _namespace: str) -> set[str]:
        return self.uids

    async def endpoint_uid(self, _namespace: str, _name: str) -> str | None:
        return None

    async def patch_endpoint_status(self, *_: Any, **__: Any) -> bool:
        return True

    async def patch_transfer_status(self, *_: Any, **__: Any) -> bool:
        return True


def test_a_planning_loop_tracks_its_endpoints_and_forgets_them_when_it_ends() -> None:
    from kvbridge_operator import reconciler
    from kvbridge_operator import testing as T
    from kvbridge_operator.config import Settings
    from kvbridge_operator.spec import parse_endpoint

    raw = T.engine_manifests("p0", "prefill") + T.engine_manifests("d0", "decode")
    for i, m in enumerate(raw):
        m["metadata"].update(namespace="ns-t", uid=f"u{i}")
    endpoints = [parse_endpoint(m) for m in raw]
    body = {**T.transfer_manifest(namespace="ns-t"), "status": {}}
    loops = reconciler.PlanningLoops()
    assert loops.tracked() == dict.fromkeys(
        ("planning_loops", "written_endpoint_statuses", "written_transfer_statuses"), 0)
    kube = _Kube({e.uid for e in endpoints})
    ctx = reconciler.Context("ns-t", "kvt", kube, Settings(debounce=0.0),  # type: ignore[arg-type]
                             emit=lambda *_: None)  # fmt: skip

    async def scenario() -> dict[str, int]:
        stopped = _Stopped()
        loop = asyncio.create_task(reconciler.run(
            ctx, loops, body=body, endpoints=lambda: endpoints, nodes=dict, stopped=stopped))
        while loops.tracked()["written_transfer_statuses"] < 1:  # the plan's last write
            await asyncio.sleep(0.01)
        during = loops.tracked()
        for _ in range(5):  # re-plans with nothing new remember nothing more
            loops.wake("ns-t", "kvt")
            await asyncio.sleep(0.01)
        assert loops.tracked() == during
        stopped.event.set()
        await loop
        return during

    during = asyncio.run(scenario())
    assert during == {"planning_loops": 1, "written_endpoint_statuses": 2,
                      "written_transfer_statuses": 1}
    assert loops.tracked() == dict.fromkeys(during, 0)


def test_transfers_are_counted_by_the_time_anyone_reads() -> None:
    """The engine's step only appends to the tally; a read of the registry (a scrape, value())
    folds it first, and a long backlog folds itself."""
    names = ("kvbridge_agent_transfer_bytes_total", "kvbridge_agent_transfer_descriptors_total",
             "kvbridge_agent_transfer_seconds_count", "kvbridge_agent_transfer_seconds_sum")
    before = [agent_metrics.value(n) for n in names]
    agent_metrics.TALLY.add(4096, 2, 0.25)
    agent_metrics.TALLY.add(8192, 4, 0.5)
    after = [agent_metrics.value(n) for n in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [12288, 6, 2, 0.75]
    bucket = agent_metrics.value("kvbridge_agent_transfer_seconds_bucket", le="0.25")
    assert bucket >= 1

    fold_at = agent_metrics.TALLY.FOLD_AT      # never scraped: the backlog stays bounded
    raw = agent_metrics.TRANSFER_BYTES._value.get()
    for _ in range(fold_at - 1):
        agent_metrics.TALLY.add(1, 1, 0.001)
    assert agent_metrics.TRANSFER_BYTES._value.get() == raw          # still in the backlog
    agent_metrics.TALLY.add(1, 1, 0.001)
    assert agent_metrics.TRANSFER_BYTES._value.get() == raw + fold_at  # folded by the add


def test_the_tally_loses_nothing_to_a_concurrent_scrape() -> None:
    import threading

    start = agent_metrics.value("kvbridge_agent_transfer_seconds_count")
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            agent_metrics.value("kvbridge_agent_transfer_bytes_total")

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(20_000):
            agent_metrics.TALLY.add(1, 1, 0.001)
    finally:
        stop.set()
        scraper.join()
    assert agent_metrics.value("kvbridge_agent_transfer_seconds_count") - start == 20_000
