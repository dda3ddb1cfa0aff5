"""A real Prometheus (kvbridge_testkit.prometheus) scraping the operator and the agents with the
chart's alert rules: its targets, and KVBridgeTransferDegraded firing and resolving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbridge_testkit import cluster as kc

from .common import NS, SYS_NS, Stage, say


def start_prometheus(stage: Stage, binaries: kc.Binaries, cleanup: list) -> Any:
    """A Prometheus on loopback scraping the operator (and, as pods start, the agents) with
    the chart's alerts; None, saying why, where it cannot run."""
    from kvbridge_testkit import prometheus as kp

    try:
        prom_binaries = kp.PromBinaries.find()
    except kp.PrometheusMissingError as exc:
        say(f"Prometheus stage skipped: {exc}")
        return None
    rules = kp.chart_rules(binaries.helm, kp.FAST_ALERTS)
    prom = kp.Prometheus(prom_binaries, kp.JOBS, rules=rules,
                         workdir=Path(stage.cluster.workdir) / "prometheus").start()
    cleanup.append(prom.stop)
    prom.set_targets(kp.OPERATOR_JOB, [(stage.operator_metrics, {"namespace": SYS_NS})])
    say(f"Prometheus {prom.url} (Debian's prometheus, temporary config and TSDB) scrapes the "
        f"operator and the agents every {prom.interval}; {len(kp.alert_rules(rules))} alert "
        "rules from the chart's PrometheusRule, `for` shortened to 2s")
    return prom


def scrape_agents(prom: Any, started: dict[str, Any]) -> None:
    """Scrape every started agent that serves metrics, labelled as a PodMonitor would."""
    from kvbridge_testkit.prometheus import AGENT_JOB

    prom.set_targets(AGENT_JOB, [
        (h.metrics_target, {"namespace": NS, "pod": name})
        for name, h in started.items() if h.metrics_target])


def show_targets(prom: Any, count: int) -> None:
    from kvbridge_testkit.sim import wait_until

    def up() -> list[dict]:
        ts = prom.targets()
        return ts if len(ts) == count and all(t["health"] == "up" for t in ts) else []

    for t in sorted(wait_until(up, timeout=60, interval=0.5, what="scrape targets up"),
                    key=lambda t: (t["labels"]["job"], t["labels"].get("pod", ""))):
        labels = t["labels"]
        say(f"  scrape target {labels['job']:<16} {t['scrapeUrl']:<34} {t['health']} "
            f"{labels.get('pod', '')}")


def follow_alert(prom: Any, name: str, target: str, timeout: float = 120) -> None:
    """Print the alert's state for KVTransfer kvt as it changes, until it is ``target``."""
    from kvbridge_testkit.sim import wait_until

    seen: list[str] = []

    def reached() -> bool:
        state = prom.alert_state(name, namespace=NS, transfer="kvt")
        if not seen or seen[-1] != state:
            seen.append(state)
            say(f"  alert {name} {{namespace={NS}, transfer=kvt}}: {state}")
        return state == target

    wait_until(reached, timeout=timeout, interval=0.25, what=f"{name} {target}")


def show_alert(prom: Any, stage: Stage, started: dict[str, Any]) -> None:
    """decode-bad makes KVBridgeTransferDegraded fire; removing it resolves it."""
    from kubernetes import client

    from kvbridge_testkit.sim import wait_until

    follow_alert(prom, "KVBridgeTransferDegraded", "firing")
    (alert,) = [a for a in prom.alerts() if a["state"] == "firing" and
                a["labels"]["alertname"] == "KVBridgeTransferDegraded" and
                a["labels"].get("transfer") == "kvt"]
    say(f"  summary: {alert['annotations']['summary']}")
    stage.delete_pod("decode-bad", started.pop("decode-bad"))
    scrape_agents(prom, started)
    say("removed pod decode-bad (its KVEndpoint is garbage-collected with it) ...")
    custom = client.CustomObjectsApi(stage.cluster.api_client())
    wait_until(lambda: "decode-bad" not in {
        e["metadata"]["name"] for e in custom.list_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints")["items"]},
        timeout=60, what="decode-bad's KVEndpoint gone")
    follow_alert(prom, "KVBridgeTransferDegraded", "inactive")
    say("  KVBridgeTransferDegraded resolved: the KVTransfer is no longer Degraded")
