"""docs/reference/alerts.md equals a regeneration from the chart's rendered PrometheusRule
(``make docs``), so an alert's expression, duration or runbook cannot change without it."""

from __future__ import annotations

from chartlib import needs_helm, tool

from kvbridge_testkit import docs_reference as ref

pytestmark = needs_helm


def test_alerts_reference_is_current() -> None:
    helm = tool("helm")
    assert helm is not None
    text = ref.alerts_markdown(ref.render_rule_groups(helm), ref.default_alerts(helm))
    path = ref.OUT / "alerts.md"
    assert path.exists() and path.read_text() == text, (
        "docs/reference/alerts.md is stale: run `make docs` and commit the result")


def test_alerts_reference_covers_every_alert_with_its_runbook() -> None:
    groups = ref.render_rule_groups(tool("helm"))
    text = (ref.OUT / "alerts.md").read_text()
    rules = [r for g in groups for r in g["rules"] if "alert" in r]
    assert rules
    for r in rules:
        assert f"\n## {r['alert']}\n" in text
        assert r["annotations"].get("runbook"), f"{r['alert']} has no runbook annotation"
    assert text.count("**Runbook:**") == len(rules)
