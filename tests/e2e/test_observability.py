"""The chart's dashboard and alerts against a real Prometheus (Debian's 2.42, our own process
on loopback) scraping the real operator and real agent processes on the local control plane.

One scenario: Prometheus scrapes the operator (as the chart's ServiceMonitor would: job
``kvbridge-metrics``, honorLabels) and the agents (as its PodMonitor would: namespace and pod
target labels), with the chart's alert rules rendered with a 2 s ``for``. A prefill and a
decode pod pair, preflight and transfer (one request fails on purpose), the webhook refuses a
malformed KVTransfer. Then:

- ``promtool check metrics`` is clean on the operator's and an agent's real /metrics;
- every dashboard query, its variables filled in for this namespace and KVTransfer, returns
  data, and the panels of things that happened show them (bytes moved > 0, ...);
- every alert: each of its selectors returns series, and its signal (the expression without
  its threshold) returns data where it has one; the transfer-failure alert fires for this
  KVTransfer (1 request of 5 failed, threshold 0.05), the absent/handshake ones do not;
- an incompatible decode pod joining makes KVBridgeTransferDegraded and
  KVBridgeIncompatibleEndpoints fire for this KVTransfer, and its leaving resolves them.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import TRANSFERS
from kvbridge_testkit import cluster as kc
from kvbridge_testkit.e2e import Api, http_get, wait_for
from kvbridge_testkit.operator_process import OperatorProcess
from kvbridge_testkit.prometheus import (
    AGENT_JOB,
    FAST_ALERTS,
    JOBS,
    OPERATOR_JOB,
    ROUTER_JOB,
    PromBinaries,
    Prometheus,
    PrometheusMissingError,
    alert_rules,
    chart_rules,
    dashboard_queries,
    selectors,
    signal,
    substitute,
)
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

SEED = 5
LOCAL = [[1, 2, 3, 4], [10, 11]]
REMOTE = [[20, 21, 22, 23], [40, 63]]
#: Panels that must show activity, not only series: what the scenario did.
ACTIVE_PANELS = {"Throughput", "Bytes moved", "Descriptors moved", "Transfer latency",
                 "Handshake latency", "Failures by cause", "Admission refusals",
                 "Reconcile latency", "Peers loaded", "Operator up"}


@pytest.fixture
def prom_binaries() -> PromBinaries:
    try:
        return PromBinaries.find()
    except PrometheusMissingError as exc:
        pytest.fail(str(exc), pytrace=False)  # never a silent skip: CI must run these


@pytest.fixture
def pods(cluster, ns: str) -> Iterator[list[SimPod]]:
    create_agent_rbac(cluster.api_client(), ns)
    made: list[SimPod] = []
    yield made
    for p in made:
        p.close()


@pytest.fixture
def router(cluster, ns: str, tmp_path: Path) -> Iterator[str]:
    """kvbridge-router for KVTransfer kvt as a process; yields host:port of its /metrics."""
    port = kc.free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_router", "--transfer", "kvt", "--namespace", ns,
         "--host", "127.0.0.1", "--port", str(port), "--kubeconfig", str(cluster.kubeconfig)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def router_ready(address: str) -> bool:
    try:
        return http_get(f"http://{address}/health")[0] == 200
    except OSError:         # not listening yet, or 503 (no verified pair yet)
        return False


def start(pods: list[SimPod], prom: Prometheus, cluster, ns: str, name: str, role: str,
          engine: str, **kw) -> SimPod:  # fmt: skip
    """An agent process serving its metrics on a free loopback port, added to the scrape."""
    p = SimPod(cluster, ns, name, role=role, engine_id=engine, seed=SEED,
               extra_args=["--metrics-port", "0"], **kw)
    pods.append(p)
    p.start()
    set_agent_targets(prom, ns, pods)
    return p


def set_agent_targets(prom: Prometheus, ns: str, pods: list[SimPod]) -> None:
    prom.set_targets(AGENT_JOB, [(f"127.0.0.1:{p.ready['metrics_port']}",
                                  {"namespace": ns, "pod": p.name})
                                 for p in pods if p.proc is not None])


def values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_dashboard_and_alerts_on_a_real_prometheus(
        cluster, api: Api, ns: str, operator: OperatorProcess, pods: list[SimPod],
        prom_binaries: PromBinaries, router: str, tmp_path: Path) -> None:  # fmt: skip
    rules = chart_rules(cluster.binaries.helm, FAST_ALERTS)
    alerts = alert_rules(rules)
    with Prometheus(prom_binaries, JOBS, rules=rules, workdir=tmp_path / "prometheus") as prom:
        prom.set_targets(OPERATOR_JOB, [(f"127.0.0.1:{operator.ports['metrics']}",
                                         {"namespace": "kvbridge-system"})])

        def targets_up(n: int) -> list[dict]:
            ts = prom.targets()
            return ts if len(ts) == n and all(t["health"] == "up" for t in ts) else []

        # Prometheus counts what happens after its first scrape of a target (a counter first
        # seen at 5 has increased by nothing), and discovers a new target within ~5 s.
        wait_for(lambda: targets_up(1), timeout=60, what="operator target up")
        api.create_transfer(ns)
        p = start(pods, prom, cluster, ns, "p-0", "prefill", "P")
        d = start(pods, prom, cluster, ns, "d-0", "decode", "D", preset="mixed")
        wait_for(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=60, what="preflight")
        api.wait_condition(ns, "Ready", "True", timeout=60)
        wait_for(lambda: targets_up(3), timeout=60, what="agent targets up")
        # The first preflight may predate the first scrape of the decode agent: a prefill
        # restart (new epoch) makes it handshake again, in Prometheus' sight.
        epoch = p.restart()["epoch"]
        set_agent_targets(prom, ns, pods)
        wait_for(lambda: d.status()["peers"] == {"p-0": epoch} and handshakes_ok(d),
                 timeout=60, what="re-handshake at the new epoch")
        api.wait_condition(ns, "Ready", "True", timeout=60)
        # The P/D router of this KVTransfer, scraped as the chart's router PodMonitor would.
        prom.set_targets(ROUTER_JOB, [(router, {"namespace": ns})])
        wait_for(lambda: router_ready(router), timeout=60,
                 what="the router seeing the verified pair")

        for i in range(4):
            p.call("hold", request_ids=[f"r{i}"])
            res = d.call("pull", request_id=f"r{i}", remote_engine_id="P",
                         local_block_ids=LOCAL, remote_block_ids=REMOTE, verify_seed=SEED,
                         timeout_s=5.0)
            assert res["ok"] and res["verified"], res
        bad = d.call("pull", request_id="out-of-range", remote_engine_id="P",
                     local_block_ids=[[4096], [4097]], remote_block_ids=[[1], [2]],
                     timeout_s=5.0)
        assert not bad["ok"] and bad["cause"] == "invalid_request", bad
        refused = manifests.transfer_manifest("refused")
        refused["spec"]["protocolVersion"] = 10
        with pytest.raises(ApiException) as exc:
            api.create(TRANSFERS, ns, refused)
        assert exc.value.status == 422

        # promtool lints the real endpoints (names, units, types, HELP).
        for what, url in (("operator", operator.metrics_url),
                          ("agent", f"http://127.0.0.1:{d.ready['metrics_port']}/metrics")):
            text = http_get(url)[1]
            assert "kvbridge_" in text
            lint = prom_binaries.promtool_run("check", "metrics", input=text)
            assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (
                what, lint.stdout + lint.stderr)

        wait_for(lambda: targets_up(4), timeout=60, what="4 scrape targets up")

        # -- the dashboard ----------------------------------------------------------------
        targets, variables = dashboard_queries()
        fill = {"namespace": ns, "transfer": "kvt", "job": OPERATOR_JOB,
                "__rate_interval": "10m", "__range": "1h"}

        def lacking(got: dict[tuple[str, str], list[dict]]) -> list[tuple[str, str, list]]:
            """(panel, query, result) without data, or without activity where there was."""
            return [(t, substitute(e, fill), r) for (t, e), r in got.items() if not r or (
                t in ACTIVE_PANELS and not any(v > 0 for v in values(r)))]

        def panel_results() -> dict[tuple[str, str], list[dict]]:
            got = {(t, e): prom.query(substitute(e, fill)) for t, e in targets}
            return {} if lacking(got) else got

        try:
            got = wait_for(panel_results, timeout=90, interval=1.0, what="dashboard data")
        except AssertionError:
            last = {(t, e): prom.query(substitute(e, fill)) for t, e in targets}
            raise AssertionError(f"dashboard queries lacking data: {lacking(last)}") from None
        assert all(not math.isnan(v) for (t, _), r in got.items() if t in ACTIVE_PANELS
                   for v in values(r))
        by_title = {t: r for (t, _), r in got.items()}
        assert {r["metric"].get("cause") for r in by_title["Failures by cause"]
                if float(r["value"][1]) > 0} == {"invalid_request"}
        assert {(r["metric"]["resource"], r["metric"]["reason"])
                for r in by_title["Admission refusals"]
                if float(r["value"][1]) > 0} == {("kvtransfers", "invalid_spec")}
        label_values = {
            "job": prom.api("label/job/values", **{"match[]": "kvbridge_reconciles_total"}),
            "namespace": prom.api("label/namespace/values",
                                  **{"match[]": "kvbridge_transfer_condition"}),
            "transfer": prom.api("label/transfer/values", **{
                "match[]": f'kvbridge_transfer_condition{{namespace=~"{ns}"}}'}),
        }
        assert [v for v in variables if "label_values" not in v] == []
        assert OPERATOR_JOB in label_values["job"]
        assert ns in label_values["namespace"] and label_values["transfer"] == ["kvt"]

        # -- the alerts -------------------------------------------------------------------
        for name, rule in alerts.items():
            for sel in selectors(rule["expr"]):
                assert prom.query(sel), f"{name}: no series for {sel}"
            sig = signal(rule["expr"])
            if sig is not None:
                assert prom.query(sig), f"{name}: no data for {sig}"
        ratio = prom.query(signal(alerts["KVBridgeHandshakeFailures"]["expr"]))
        assert {(r["metric"]["namespace"], r["metric"]["transfer"]) for r in ratio} >= {
            (ns, "kvt")} and all(v == 0 for v in values(ratio))
        wait_for(lambda: prom.alert_state("KVBridgeTransferFailures", namespace=ns,
                                          transfer="kvt") == "firing",
                 timeout=60, what="KVBridgeTransferFailures firing (1 of 5 requests failed)")
        for healthy in ("KVBridgeOperatorAbsent", "KVBridgeOperatorNotReconciling",
                        "KVBridgeHandshakeFailures"):
            assert prom.query(alerts[healthy]["expr"]) == [], healthy
        assert prom.alert_state("KVBridgeTransferDegraded", namespace=ns) == "inactive"

        # An incompatible decode engine joins: Degraded fires; it leaves: Degraded resolves.
        b = start(pods, prom, cluster, ns, "bad-0", "decode", "BAD", preset="bad-block")
        for name in ("KVBridgeTransferDegraded", "KVBridgeIncompatibleEndpoints"):
            wait_for(lambda name=name: prom.alert_state(name, namespace=ns, transfer="kvt")
                     == "firing", timeout=120, interval=0.5, what=f"{name} firing")
        (firing,) = [a for a in prom.alerts()
                     if a["labels"]["alertname"] == "KVBridgeTransferDegraded"
                     and a["labels"]["namespace"] == ns]
        assert firing["annotations"]["summary"] == f"KVTransfer {ns}/kvt is Degraded."
        assert f"kubectl describe kvtransfer -n {ns} kvt" in firing["annotations"]["runbook"]
        assert firing["labels"]["severity"] == "warning"

        b.kill()
        b.delete_pod()
        pods.remove(b)
        set_agent_targets(prom, ns, pods)
        wait_for(lambda: "bad-0" not in api.endpoints(ns), timeout=60, what="bad-0 GC")
        for name in ("KVBridgeTransferDegraded", "KVBridgeIncompatibleEndpoints"):
            wait_for(lambda name=name: prom.alert_state(name, namespace=ns, transfer="kvt")
                     == "inactive", timeout=120, interval=0.5, what=f"{name} resolved")
        assert api.condition(ns, "Degraded")["status"] == "False"
        assert prom.alert_state("KVBridgeTransferDegraded", namespace=ns) == "inactive"
