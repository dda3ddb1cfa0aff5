"""The chart on a real local control plane (kube-apiserver v1.20.2): server-side dry run,
install, upgrade, uninstall, and what the installed ServiceAccounts may and may not do.

There is no kubelet here: the operator Deployment's pods stay Pending, which is expected.
"""

from __future__ import annotations

import base64

import pytest
import yaml
from chartlib import CHART, HelmError, Kube, values_file, wait_for

pytestmark = pytest.mark.k8s

NS = "kvbridge-system"
RELEASE = "kvbridge"
CRDS = {"kvtransfers.kvbridge.io", "kvendpoints.kvbridge.io", "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev"}


def _left_behind(before: set, after: set) -> set:
    """New objects, less the ones Helm documents as kept (CRDs, and the API groups they add)."""
    return {o for o in after - before
            if o[0] != "CustomResourceDefinition"
            and not (o[0] == "APIService" and o[2] in {"v1alpha1.kvbridge.io", "v1.kopf.dev"})}


def _uninstall(kube: Kube, release: str, namespace: str) -> None:
    kube.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s", check=False)


def test_dry_run_server_creates_nothing(kube: Kube) -> None:
    kube.create_namespace(NS)
    before = kube.snapshot()
    out = kube.helm("install", RELEASE, str(CHART), "-n", NS, "--dry-run=server")
    manifest = [d for d in yaml.safe_load_all(out.split("MANIFEST:", 1)[1].split("NOTES:")[0])
                if d]
    kinds = {d["kind"] for d in manifest}
    assert {"Deployment", "ClusterRole", "ValidatingWebhookConfiguration", "Secret"} <= kinds
    assert kube.snapshot() == before, "--dry-run=server changed the cluster"
    assert "helm uninstall" in out  # NOTES rendered

    # It really asks the server: an object of the same name that Helm does not own is refused.
    kube.kubectl("create", "clusterrole", RELEASE, "--verb=get", "--resource=pods")
    try:
        with pytest.raises(HelmError, match="exists and cannot be imported"):
            kube.helm("install", RELEASE, str(CHART), "-n", NS, "--dry-run=server")
    finally:
        kube.kubectl("delete", "clusterrole", RELEASE)


def _command(kube: Kube) -> list[str]:
    dep = kube.get("deployment", RELEASE, "-n", NS)
    return dep["spec"]["template"]["spec"]["containers"][0]["command"]


def test_install_upgrade_uninstall(kube: Kube) -> None:
    kube.create_namespace(NS)
    before = kube.snapshot()
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS)
        for crd in CRDS:
            kube.kubectl("wait", "--for=condition=established", f"crd/{crd}", "--timeout=30s")
        dep = kube.get("deployment", RELEASE, "-n", NS)
        assert dep["spec"]["replicas"] == 1
        assert "--debug" not in _command(kube)
        assert kube.exists("clusterkopfpeering", "kvbridge")
        for obj in (("serviceaccount", "kvbridge-agent"), ("role", "kvbridge-agent"),
                    ("service", "kvbridge-webhook"), ("service", "kvbridge-metrics")):
            assert kube.exists(*obj, "-n", NS), obj
        secret = kube.get("secret", "kvbridge-webhook-tls", "-n", NS)
        vwc = kube.get("validatingwebhookconfiguration", RELEASE)
        assert {w["clientConfig"]["caBundle"] for w in vwc["webhooks"]} == {
            secret["data"]["ca.crt"]}
        # The controller-manager acts on the Deployment (no kubelet, so pods stay Pending).
        wait_for(lambda: kube.kubectl("get", "replicasets", "-n", NS, "-o", "name").stdout,
                 "a ReplicaSet for the operator Deployment")

        kube.helm("upgrade", RELEASE, str(CHART), "-n", NS, "--set", "operator.logLevel=debug")
        assert "--debug" in _command(kube)
        dep2 = kube.get("deployment", RELEASE, "-n", NS)
        assert dep2["metadata"]["generation"] > dep["metadata"]["generation"]
        wait_for(lambda: len(kube.kubectl("get", "replicasets", "-n", NS, "-o", "name")
                             .stdout.split()) == 2, "a second ReplicaSet after the upgrade")
        # The generated webhook certificate survives upgrades (lookup), and so does the bundle.
        assert kube.get("secret", "kvbridge-webhook-tls", "-n", NS)["data"] == secret["data"]
        vwc2 = kube.get("validatingwebhookconfiguration", RELEASE)
        assert [w["clientConfig"]["caBundle"] for w in vwc2["webhooks"]] == [
            w["clientConfig"]["caBundle"] for w in vwc["webhooks"]]

        kube.helm("upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values",
                  "--set", "operator.replicas=0")
        assert kube.get("deployment", RELEASE, "-n", NS)["spec"]["replicas"] == 0
        assert "--debug" in _command(kube)
        history = kube.helm("history", RELEASE, "-n", NS, "-o", "yaml")
        assert [r["revision"] for r in yaml.safe_load(history)] == [1, 2, 3]
    finally:
        _uninstall(kube, RELEASE, NS)

    assert not kube.exists("deployment", RELEASE, "-n", NS)
    # ReplicaSets, pods and token Secrets go with their owners, asynchronously.
    wait_for(lambda: not _left_behind(before, kube.snapshot()),
             "nothing but the CRDs left after helm uninstall", timeout=60, interval=1)
    assert {o[2] for o in kube.snapshot() if o[0] == "CustomResourceDefinition"} >= CRDS


def test_namespaced_install(kube: Kube) -> None:
    for ns in (NS, "team-a", "team-b"):
        kube.create_namespace(ns)
    before = kube.snapshot()
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS, "-f",
                  str(values_file("namespaced")))
        for ns in ("team-a", "team-b"):
            role = kube.get("role", RELEASE, "-n", ns)
            assert {r for rule in role["rules"] for r in rule["resources"]} >= {
                "kvtransfers", "kvendpoints", "kopfpeerings"}
            assert kube.exists("kopfpeering", "kvbridge", "-n", ns)
            assert kube.exists("rolebinding", "kvbridge-agent", "-n", ns)
        assert not kube.exists("clusterkopfpeering", "kvbridge")
        assert kube.exists("validatingwebhookconfiguration", f"{RELEASE}-{NS}")
        assert "--namespace=team-a" in _command(kube)
    finally:
        _uninstall(kube, RELEASE, NS)
    wait_for(lambda: not _left_behind(before, kube.snapshot()),
             "nothing but the CRDs left after helm uninstall", timeout=60, interval=1)


def _can_i(kube: Kube, sa: str, verb: str, resource: str, namespace: str) -> bool:
    proc = kube.kubectl("auth", "can-i", verb, resource, "-n", namespace,
                        f"--as=system:serviceaccount:{NS}:{sa}", check=False)
    return proc.stdout.strip() == "yes"


def test_service_account_permissions(kube: Kube) -> None:
    """What the chart's ServiceAccounts may do, asked of the API server's RBAC authorizer."""
    for ns in (NS, "other"):
        kube.create_namespace(ns)
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS, "--set", "webhook.enabled=false")
        allowed = [
            ("kvbridge-agent", "create", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "patch", "kvendpoints.kvbridge.io/status", NS),
            ("kvbridge-agent", "update", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "watch", "kvtransfers.kvbridge.io", NS),
            ("kvbridge", "patch", "kvtransfers.kvbridge.io/status", "other"),
            ("kvbridge", "watch", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge", "list", "pods", "other"),
            ("kvbridge", "create", "events", "other"),
            ("kvbridge", "patch", "clusterkopfpeerings.kopf.dev", ""),
        ]
        denied = [
            ("kvbridge-agent", "delete", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "list", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "create", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge-agent", "update", "kvtransfers.kvbridge.io", NS),
            ("kvbridge-agent", "get", "pods", NS),
            ("kvbridge-agent", "get", "secrets", NS),
            ("kvbridge", "get", "secrets", NS),
            ("kvbridge", "delete", "pods", "other"),
            ("kvbridge", "create", "kvtransfers.kvbridge.io", "other"),
            ("kvbridge", "delete", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge", "update", "kvtransfers.kvbridge.io", "other"),
            ("kvbridge", "create", "validatingwebhookconfigurations", ""),
        ]
        for case in allowed:
            assert _can_i(kube, *case), f"expected allowed: {case}"
        for case in denied:
            assert not _can_i(kube, *case), f"expected denied: {case}"
        # Tokens for the chart's ServiceAccounts can be minted (the topology test uses them).
        token = kube.cluster.service_account_token(NS, "kvbridge-agent")
        payload = token.split(".")[1]
        claims = yaml.safe_load(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        assert claims["sub"] == f"system:serviceaccount:{NS}:kvbridge-agent"
    finally:
        _uninstall(kube, RELEASE, NS)
