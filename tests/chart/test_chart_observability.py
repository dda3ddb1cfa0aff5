"""The chart's Grafana dashboard and PrometheusRule: rendered objects, their PromQL checked
by a real ``promtool`` (``check rules``, and ``test rules`` with tests/chart/alerts_test.yaml),
and every metric they name exported by the operator or the agent.

The queries returning data from a real Prometheus scraping a running operator and agents is
tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartlib import CHART, HelmError, by_kind, needs_helm, one, render, tool

from kvbridge_testkit.prometheus import (
    DASHBOARD,
    PromBinaries,
    PrometheusMissingError,
    alert_rules,
    chart_rules,
    dashboard_queries,
    substitute,
)

pytestmark = needs_helm

ALERTS = {
    "KVBridgeTransferDegraded", "KVBridgeTransferNotReady", "KVBridgeIncompatibleEndpoints",
    "KVBridgeTransportFallback", "KVBridgeRevisionWithoutPeer",
    "KVBridgeHandshakeFailures", "KVBridgeTransferFailures", "KVBridgeLateReads",
    "KVBridgeOperatorAbsent",
    "KVBridgeOperatorNotReconciling", "KVBridgeRouterNoVerifiedPair", "KVBridgeRouterFailures",
}
#: Values for every dashboard variable, for checks that need plain PromQL.
DASH_VARS = {"namespace": "serving", "transfer": "kvt", "job": "kvbridge-metrics",
             "__rate_interval": "1m", "__range": "1h"}


@pytest.fixture(scope="module")
def prom() -> PromBinaries:
    try:
        return PromBinaries.find()
    except PrometheusMissingError as exc:
        pytest.fail(str(exc), pytrace=False)  # never a silent skip: CI must run these


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    return chart_rules(str(tool("helm")))


def _check_rules(prom: PromBinaries, groups: dict[str, Any], path: Path) -> str:
    path.write_text(yaml.safe_dump(groups))
    out = prom.promtool_run("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_rules_pass_promtool_check(prom: PromBinaries, rules: dict, tmp_path: Path) -> None:
    assert set(alert_rules(rules)) == ALERTS
    out = _check_rules(prom, rules, tmp_path / "rules.yaml")
    assert f"SUCCESS: {len(ALERTS)} rules found" in out, out


def test_alerts_pass_promtool_unit_tests(prom: PromBinaries, rules: dict,
                                         tmp_path: Path) -> None:  # fmt: skip
    """tests/chart/alerts_test.yaml: each alert fires after its threshold, not before, not when
    healthy. promtool compares annotations verbatim, so they are left out here."""
    bare = {"groups": [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"}
                                       for r in g["rules"]]} for g in rules["groups"]]}
    (tmp_path / "kvbridge-rules.yaml").write_text(yaml.safe_dump(bare))
    shutil.copy(Path(__file__).with_name("alerts_test.yaml"), tmp_path / "alerts_test.yaml")
    out = prom.promtool_run("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)",
                            Path(__file__).with_name("alerts_test.yaml").read_text()))
    assert tested == ALERTS


def test_dashboard_queries_pass_promtool_check(prom: PromBinaries, tmp_path: Path) -> None:
    """Every panel query and variable query is valid PromQL (checked as recording rules)."""
    targets, variables = dashboard_queries()
    assert len(targets) >= 20
    exprs = [substitute(e, DASH_VARS) for _, e in targets]
    # label_values(METRIC{...}, LABEL) is Grafana's; its selector must be valid PromQL.
    exprs += [re.fullmatch(r"label_values\((.+), *\w+\)", v).group(1) for v in variables]
    groups = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvbridge_dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    _check_rules(prom, groups, tmp_path / "dashboard.yaml")


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\b(kvbridge_[a-z_]+)\b", text))


def _family(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", name)


def test_every_metric_queried_is_exported(rules: dict) -> None:
    from prometheus_client import REGISTRY

    from kvbridge_agent import metrics as agent_metrics
    from kvbridge_operator import metrics as operator_metrics  # noqa: F401 - registers them
    from kvbridge_router import metrics as router_metrics

    exported = {m.name for r in (REGISTRY, agent_metrics.REGISTRY, router_metrics.REGISTRY)
                for m in r.collect()}  # fmt: skip
    used = _metric_names(DASHBOARD.read_text()) | _metric_names(json.dumps(rules))
    missing = {n for n in used if _family(n) not in exported}
    assert not missing, f"queried but exported by neither the operator nor the agent: {missing}"


def test_dashboard_covers_the_topology_handshakes_transfers_and_operator() -> None:
    targets, _ = dashboard_queries()
    used = {_family(n) for _, e in targets for n in _metric_names(e)}
    assert {
        "kvbridge_transfer_condition", "kvbridge_endpoints", "kvbridge_pairs",
        "kvbridge_incompatible_pairs", "kvbridge_agent_handshake_seconds",
        "kvbridge_agent_handshakes", "kvbridge_agent_transfer_bytes",
        "kvbridge_agent_transfer_descriptors", "kvbridge_agent_transfer_seconds",
        "kvbridge_agent_transfer_failures", "kvbridge_reconcile_duration_seconds",
        "kvbridge_admission_refusals", "kvbridge_agent_info", "kvbridge_router_requests",
        "kvbridge_router_retries", "kvbridge_router_verified_pairs",
        "kvbridge_router_time_to_first_token_seconds", "kvbridge_router_info",
        "kvbridge_pair_transport", "kvbridge_transport_fallback_pairs",
        "kvbridge_agent_peer_transport", "kvbridge_router_pick_prompt_blocks",
        "kvbridge_router_pick_cache_hit_blocks",
    } <= used
    dash = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "job", "namespace", "transfer"]
    for title, expr in targets:
        if "kvbridge_agent_" in expr or "namespace" in expr:   # per-KVTransfer panels
            assert '$namespace' in expr and '$transfer' in expr, (title, expr)
        else:   # the operator's own panels
            assert '$job' in expr, (title, expr)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"]
               if p["type"] != "row")


def test_dashboard_layout() -> None:
    """Panel ids are unique and no two panels overlap on the grid (24 columns wide)."""
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_pair_choice_hit_rate_panel() -> None:
    """The router row's prefix-cache hit rate: per KVTransfer (the router's series joined
    with kvbridge_router_info by instance), the prefill's and the decode's hit blocks over the
    chosen prompts' blocks."""
    dash = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dash["panels"] if p["title"] == "Prefix cache hit rate (pair choice)"]
    router_row = next(p for p in dash["panels"] if p["title"] == "Router (kvbridge-router)")
    assert panel["gridPos"]["y"] > router_row["gridPos"]["y"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    join = ('* on (instance) group_left (namespace, transfer) kvbridge_router_info'
            '{namespace=~"$namespace", transfer=~"$transfer"}')
    prompt = ("sum by (namespace, transfer) (rate(kvbridge_router_pick_prompt_blocks_sum"
              f"[$__rate_interval]) {join})")
    assert [(t["expr"], t["legendFormat"]) for t in panel["targets"]] == [
        ("sum by (namespace, transfer) (rate(kvbridge_router_pick_cache_hit_blocks_sum"
         f'{{role="{role}"}}[$__rate_interval]) {join}) / {prompt}',
         f"{{{{namespace}}}}/{{{{transfer}}}} {role}")
        for role in ("prefill", "decode")]


def test_alert_annotations_labels_and_values() -> None:
    objs = render("observability")
    rule = one(objs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = alert_rules(rule["spec"])
    assert set(alerts) == ALERTS - {"KVBridgeTransferNotReady"}   # disabled in the values file
    for name, r in alerts.items():
        assert {"summary", "description", "runbook", "runbook_url"} <= set(r["annotations"])
        assert r["annotations"]["runbook_url"] == f"https://runbooks.example.com/kvbridge/{name}"
        assert r["labels"]["team"] == "ml-platform"
        assert r["labels"]["severity"] in {"warning", "critical"}
    failures = alerts["KVBridgeTransferFailures"]
    assert "[30m]" in failures["expr"] and failures["expr"].rstrip().endswith("> 0.2")
    assert 'absent(up{job="kvbridge-metrics"} == 1)' in alerts["KVBridgeOperatorAbsent"]["expr"]
    own = alert_rules(chart_rules(str(tool("helm")), ["prometheusRule.operatorJob=ops-kvb"]))
    assert 'up{job="ops-kvb"}' in own["KVBridgeOperatorAbsent"]["expr"]
    assert "runbook_url" not in own["KVBridgeOperatorAbsent"]["annotations"]


def test_revision_without_peer_alert() -> None:
    """Engines of a model revision that no engine of the other role matches: the rule reads
    the operator's per-revision gauges, keeps the revision label, and has a toggle."""
    alerts = alert_rules(one(render("observability"), "PrometheusRule")["spec"])
    rule = alerts["KVBridgeRevisionWithoutPeer"]
    expr = " ".join(rule["expr"].split())
    assert expr == ("sum by (namespace, transfer, revision) (kvbridge_transfer_revision_engines)"
                    " > 0 unless on (namespace, transfer, revision)"
                    " kvbridge_transfer_revision_pairs > 0")
    assert rule["for"] == "10m" and rule["labels"]["severity"] == "warning"
    notes = rule["annotations"]
    assert "{{ $labels.revision }}" in notes["summary"]
    assert "RevisionsMatched" in notes["runbook"] and "status.revisions" in notes["runbook"]
    assert notes["runbook_url"].endswith("/KVBridgeRevisionWithoutPeer")
    off = alert_rules(chart_rules(str(tool("helm")),
                                  ["prometheusRule.alerts.revisionWithoutPeer.enabled=false"]))
    assert "KVBridgeRevisionWithoutPeer" not in off and "KVBridgeTransportFallback" in off


def test_dashboard_configmap() -> None:
    objs = render("observability")
    cm = one(objs, "ConfigMap", "kvbridge-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard_kvbridge"] == "yes"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kvbridge"}
    assert json.loads(cm["data"]["kvbridge.json"]) == json.loads(DASHBOARD.read_text())
    plain = one(render(sets=["dashboards.enabled=true"]), "ConfigMap", "kvbridge-dashboard")
    assert plain["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert plain["metadata"]["namespace"] == "kvbridge-system"


def test_monitors() -> None:
    objs = render("observability")
    pm = one(objs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    assert pm["spec"]["selector"] == {"matchLabels": {"kvbridge.io/agent": "true"}}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "kvb-metrics"
    sm = one(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True   # keeps the KVTransfers' namespace


def test_observability_is_off_by_default() -> None:
    objs = render()
    for kind in ("PrometheusRule", "PodMonitor", "ServiceMonitor"):
        assert not by_kind(objs, kind)
    assert not [o for o in by_kind(objs, "ConfigMap") if "dashboard" in o["metadata"]["name"]]


@pytest.mark.parametrize(("sets", "fragment"), [
    (["prometheusRule.alerts.transferFailures.ratio=2"], "/alerts/transferFailures/ratio"),
    (["prometheusRule.alerts.transferFailures.ratio=1.5"], "/alerts/transferFailures/ratio"),
    (["prometheusRule.alerts.transferDegraded.for=10 minutes"], "/alerts/transferDegraded/for"),
    (["prometheusRule.alerts.transferDegraded.forr=10m"], "properties 'forr' not allowed"),
    (["dashboards.labelValue=not a label"], "/dashboards/labelValue"),
])  # fmt: skip
def test_schema_rejects_bad_observability_values(sets: list[str], fragment: str) -> None:
    with pytest.raises(HelmError) as err:
        render(sets=sets)
    assert fragment in str(err.value), str(err.value)


def test_dashboard_file_is_in_the_chart() -> None:
    assert DASHBOARD.parent.parent == CHART
