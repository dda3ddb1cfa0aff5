"""The chart, unmodified, on a real node: the operator Deployment runs the locally built
image as a pod (non-root, read-only root filesystem, in-cluster pod-bound token), its probes
pass, the API server calls the admission webhook through its Service, the metrics Service is
scraped from inside the cluster, and the operator survives its pod's deletion and a
``helm upgrade`` to a new image tag without changing any status it wrote."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from chartlib import CHART, Kube
from nodelib import (
    AGENT_NS,
    OPERATOR_NS,
    RELEASE,
    container_pid,
    process_identity,
    token_claims,
    wait_pod_ready,
    wait_rollout,
)

from kvbridge_operator import testing as manifests
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.node_pods import image_values

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.slow]


def operator_pods(api: Api) -> list[Any]:
    """The operator's pods that are not being deleted."""
    pods = api.core.list_namespaced_pod(
        OPERATOR_NS, label_selector="app.kubernetes.io/component=operator").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def operator_pod(api: Api) -> Any:
    live = operator_pods(api)
    assert len(live) == 1, [p.metadata.name for p in live]
    return live[0]


def statuses(api: Api) -> dict[str, Any]:
    """What the operator wrote, less the clocks: KVTransfer conditions and endpoint verdicts."""
    transfer = api.transfer(AGENT_NS)["status"]
    conditions = sorted((c["type"], c["status"], c["reason"]) for c in transfer["conditions"])
    verdicts = {name: {k: v for k, v in (ep.get("status") or {}).items()
                       if k not in {"handshakes", "lastSync"}}
                for name, ep in api.endpoints(AGENT_NS).items()}  # fmt: skip
    return {"conditions": conditions, "pairs": transfer.get("pairs"), "verdicts": verdicts}


def test_operator_pod_ready_nonroot_readonly_with_pod_token(api: Api, node: Any,
                                                            release: str) -> None:
    pod = operator_pod(api)
    assert pod.spec.node_name == node.name
    status = pod.status.container_statuses[0]
    assert status.ready and status.restart_count == 0  # readiness and liveness probes pass
    pid = container_pid(node, status.container_id)
    ident = process_identity(pid)
    assert ident["uid"] == [65532] * 4 and ident["gid"][0] == 65532
    assert ident["root_read_only"] and ident["no_new_privs"] and ident["cap_eff"] == 0
    claims = token_claims(pid)
    assert claims["kubernetes.io"]["pod"]["name"] == pod.metadata.name
    assert claims["kubernetes.io"]["serviceaccount"]["name"] == pod.spec.service_account_name
    assert pod.spec.service_account_name == release  # the chart's operator ServiceAccount


def test_webhook_called_through_its_service_refuses_malformed(kube: Kube, release: str) -> None:
    vwc = kube.get("validatingwebhookconfiguration", release)
    refs = {json.dumps(w["clientConfig"].get("service"), sort_keys=True) for w in vwc["webhooks"]}
    assert all(json.loads(r)["namespace"] == OPERATOR_NS for r in refs)
    assert not any("url" in w["clientConfig"] for w in vwc["webhooks"])
    # Schema-valid, rejected by a cross-field rule only the webhook knows.
    bad = manifests.transfer_manifest("bad-tp", AGENT_NS, prefill_tp=3, decode_tp=2)
    proc = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    assert "admission webhook" in proc.stderr and "denied the request" in proc.stderr
    assert "spec.decode.tensorParallelSize: expected a multiple or divisor" in proc.stderr
    assert not kube.exists("kvtransfer", "bad-tp", "-n", AGENT_NS)
    good = manifests.transfer_manifest("good-tp", AGENT_NS, prefill_tp=4, decode_tp=2)
    kube.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(good))


def test_metrics_service_scraped_from_inside_the_cluster(api: Api, release: str,
                                                         images: dict[str, str]) -> None:
    """A pod in the release's namespace reads the metrics Service by its ClusterIP (the
    service environment variables), as a Prometheus in the cluster would."""
    script = ("import os, urllib.request\n"
              "host = os.environ['KVBRIDGE_METRICS_SERVICE_HOST']\n"
              "port = os.environ['KVBRIDGE_METRICS_SERVICE_PORT']\n"
              "print(urllib.request.urlopen(f'http://{host}:{port}/metrics', timeout=10)"
              ".read().decode())\n")  # fmt: skip
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "scrape-metrics"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "scrape", "image": images["KVB_IMAGE_AGENT"], "imagePullPolicy": "Never",
            "command": ["/opt/kvbridge/bin/python", "-c", script]}]},
    }  # fmt: skip
    api.core.create_namespaced_pod(OPERATOR_NS, pod)
    try:
        phase = wait_for(lambda: (lambda p: p if p in {"Succeeded", "Failed"} else None)(
            api.core.read_namespaced_pod("scrape-metrics", OPERATOR_NS).status.phase),
            timeout=120, what="the scraping pod finished")  # fmt: skip
        text = api.core.read_namespaced_pod_log("scrape-metrics", OPERATOR_NS)
        assert phase == "Succeeded", text
        assert "kvbridge_" in text and "# TYPE" in text, text[:500]
    finally:
        api.core.delete_namespaced_pod("scrape-metrics", OPERATOR_NS, grace_period_seconds=0)


def test_deleted_operator_pod_is_recreated_and_statuses_stay(api: Api, kube: Kube,
                                                             agents: dict[str, str]) -> None:
    api.wait_condition(AGENT_NS, "Ready", "True", timeout=60)
    before = statuses(api)
    old = operator_pod(api)
    api.core.delete_namespaced_pod(old.metadata.name, OPERATOR_NS)
    new = wait_for(lambda: next((p for p in operator_pods(api)
                                 if p.metadata.uid != old.metadata.uid), None),
                   timeout=60, what="a replacement operator pod")  # fmt: skip
    wait_pod_ready(api, OPERATOR_NS, new.metadata.name, timeout=120)
    wait_rollout(kube)
    assert statuses(api) == before


def test_helm_upgrade_to_new_tag_rolls_operator_and_keeps_state(
        api: Api, kube: Kube, node: Any, images: dict[str, str],
        agents: dict[str, str]) -> None:  # fmt: skip
    api.wait_condition(AGENT_NS, "Ready", "True", timeout=60)
    before = statuses(api)
    old = operator_pod(api)
    new_image = images["KVB_IMAGE_OPERATOR"].rsplit(":", 1)[0] + ":upgrade"
    node.tag(images["KVB_IMAGE_OPERATOR"], new_image)
    kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
              *image_values(new_image), timeout=180)  # fmt: skip
    wait_rollout(kube)
    pod = operator_pod(api)
    assert pod.metadata.uid != old.metadata.uid
    assert pod.spec.containers[0].image == new_image
    assert pod.status.container_statuses[0].ready
    assert statuses(api) == before
    api.wait_condition(AGENT_NS, "Ready", "True", timeout=30)
