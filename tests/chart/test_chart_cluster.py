"""The chart on a real local control plane (kube-apiserver v1.20.2): server-side dry run,
install, upgrade, uninstall, and what the installed ServiceAccounts may and may not do.

There is no kubelet here: the operator Deployment's pods stay Pending, which is expected
(tests/node runs the chart on a real node).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartlib import CHART, REPO, HelmError, Kube, values_file, wait_for
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.k8s

NS = "kvbridge-system"
RELEASE = "kvbridge"
CRDS = {
    "kvtransfers.kvbridge.io",
    "kvendpoints.kvbridge.io",
}


def _left_behind(before: set, after: set) -> set:
    """New objects, less the ones Helm documents as kept (CRDs, and the API groups they add)."""
    return {
        o
        for o in after - before
        if o[0] != "CustomResourceDefinition"
        and not (o[0] == "APIService" and o[2] == "v1alpha1.kvbridge.io")
    }


def _uninstall(kube: Kube, release: str, namespace: str) -> None:
    kube.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s", check=False)


def test_dry_run_server_creates_nothing(kube: Kube) -> None:
    kube.create_namespace(NS)
    before = kube.snapshot()
    out = kube.helm("install", RELEASE, str(CHART), "-n", NS, "--dry-run=server")
    manifest = [d for d in yaml.safe_load_all(out.split("MANIFEST:", 1)[1].split("NOTES:")[0]) if d]
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
        assert dep["spec"]["replicas"] == 2
        assert "--debug" not in _command(kube)
        for obj in (
            ("role", "kvbridge-leader-election"),
            ("rolebinding", "kvbridge-leader-election"),
            ("poddisruptionbudget", "kvbridge"),
            ("serviceaccount", "kvbridge-agent"),
            ("role", "kvbridge-agent"),
            ("service", "kvbridge-webhook"),
            ("service", "kvbridge-metrics"),
        ):
            assert kube.exists(*obj, "-n", NS), obj
        secret = kube.get("secret", "kvbridge-webhook-tls", "-n", NS)
        vwc = kube.get("validatingwebhookconfiguration", RELEASE)
        assert {w["clientConfig"]["caBundle"] for w in vwc["webhooks"]} == {
            secret["data"]["ca.crt"]
        }
        # The controller-manager acts on the Deployment (no kubelet, so pods stay Pending).
        wait_for(
            lambda: kube.kubectl("get", "replicasets", "-n", NS, "-o", "name").stdout,
            what="a ReplicaSet for the operator Deployment",
        )

        kube.helm("upgrade", RELEASE, str(CHART), "-n", NS, "--set", "operator.logLevel=debug")
        assert "--debug" in _command(kube)
        dep2 = kube.get("deployment", RELEASE, "-n", NS)
        assert dep2["metadata"]["generation"] > dep["metadata"]["generation"]
        wait_for(
            lambda: (
                len(kube.kubectl("get", "replicasets", "-n", NS, "-o", "name").stdout.split()) == 2
            ),
            what="a second ReplicaSet after the upgrade",
        )
        # The generated webhook certificate survives upgrades (lookup), and so does the bundle.
        assert kube.get("secret", "kvbridge-webhook-tls", "-n", NS)["data"] == secret["data"]
        vwc2 = kube.get("validatingwebhookconfiguration", RELEASE)
        assert [w["clientConfig"]["caBundle"] for w in vwc2["webhooks"]] == [
            w["clientConfig"]["caBundle"] for w in vwc["webhooks"]
        ]

        kube.helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "-n",
            NS,
            "--reuse-values",
            "--set",
            "operator.replicas=0",
        )
        assert kube.get("deployment", RELEASE, "-n", NS)["spec"]["replicas"] == 0
        assert "--debug" in _command(kube)
        history = kube.helm("history", RELEASE, "-n", NS, "-o", "yaml")
        assert [r["revision"] for r in yaml.safe_load(history)] == [1, 2, 3]
    finally:
        _uninstall(kube, RELEASE, NS)

    assert not kube.exists("deployment", RELEASE, "-n", NS)
    # ReplicaSets, pods and token Secrets go with their owners, asynchronously.
    wait_for(
        lambda: not _left_behind(before, kube.snapshot()),
        what="nothing but the CRDs left after helm uninstall",
        timeout=60,
        interval=1,
    )
    assert {o[2] for o in kube.snapshot() if o[0] == "CustomResourceDefinition"} >= CRDS


def test_namespaced_install(kube: Kube) -> None:
    for ns in (NS, "team-a", "team-b"):
        kube.create_namespace(ns)
    before = kube.snapshot()
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(values_file("namespaced")))
        for ns in ("team-a", "team-b"):
            role = kube.get("role", RELEASE, "-n", ns)
            assert {r for rule in role["rules"] for r in rule["resources"]} >= {
                "kvtransfers",
                "kvendpoints",
            }
            assert kube.exists("rolebinding", "kvbridge-agent", "-n", ns)
        assert kube.exists("role", "kvbridge-leader-election", "-n", NS)
        assert kube.exists("validatingwebhookconfiguration", f"{RELEASE}-{NS}")
        assert "--namespace=team-a" in _command(kube)
    finally:
        _uninstall(kube, RELEASE, NS)
    wait_for(
        lambda: not _left_behind(before, kube.snapshot()),
        what="nothing but the CRDs left after helm uninstall",
        timeout=60,
        interval=1,
    )


def _can_i(kube: Kube, sa: str, verb: str, resource: str, namespace: str) -> bool:
    # "kind/x" would mean the object named x: subresources go in --subresource (a Lease's
    # name stays: the leader election's rules are limited to one Lease).
    resource, _, sub = resource.partition("/")
    if resource.startswith("leases.") and sub:
        resource, sub = f"{resource}/{sub}", ""
    extra = [f"--subresource={sub}"] if sub else []
    proc = kube.kubectl(
        "auth",
        "can-i",
        verb,
        resource,
        *extra,
        "-n",
        namespace,
        f"--as=system:serviceaccount:{NS}:{sa}",
        check=False,
    )
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
            ("kvbridge", "patch", "kvendpoints.kvbridge.io/status", "other"),
            ("kvbridge-agent", "update", "kvendpoints.kvbridge.io/status", NS),
            ("kvbridge-agent", "get", "kvendpoints.kvbridge.io/status", NS),
            ("kvbridge", "watch", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge", "list", "nodes", ""),
            ("kvbridge", "create", "events", "other"),
            ("kvbridge", "create", "leases.coordination.k8s.io", NS),
            ("kvbridge", "update", "leases.coordination.k8s.io/kvbridge-operator", NS),
            ("kvbridge", "get", "leases.coordination.k8s.io/kvbridge-operator", NS),
        ]
        denied = [
            ("kvbridge-agent", "delete", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "list", "kvendpoints.kvbridge.io", NS),
            ("kvbridge-agent", "create", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge-agent", "update", "kvtransfers.kvbridge.io", NS),
            ("kvbridge-agent", "patch", "kvtransfers.kvbridge.io/status", NS),
            ("kvbridge", "update", "kvendpoints.kvbridge.io/status", "other"),
            ("kvbridge-agent", "get", "pods", NS),
            ("kvbridge-agent", "get", "secrets", NS),
            ("kvbridge", "get", "secrets", NS),
            ("kvbridge", "list", "pods", "other"),
            ("kvbridge", "patch", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge", "create", "kvtransfers.kvbridge.io", "other"),
            ("kvbridge", "delete", "kvendpoints.kvbridge.io", "other"),
            ("kvbridge", "update", "kvtransfers.kvbridge.io", "other"),
            ("kvbridge", "create", "validatingwebhookconfigurations", ""),
            ("kvbridge", "create", "leases.coordination.k8s.io", "other"),
            ("kvbridge", "update", "leases.coordination.k8s.io/kube-scheduler", NS),
            ("kvbridge", "delete", "leases.coordination.k8s.io/kvbridge-operator", NS),
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


def test_gateway_on_a_real_api_server(kube: Kube) -> None:
    """gateway.enabled with installInferencePoolCRD on a cluster that lacks the CRD: the first
    install adds the CRD (the pool's API does not exist yet when Helm renders), the upgrade
    adds the InferencePool, which the API server validates against the CRD; the picker and the
    decode pods' ServiceAccount may read KVTransfers and KVEndpoints (the picker Pods too) and
    nothing more; the CRD
    outlives an uninstall."""
    serving = "gateway-serving"
    for ns in (NS, serving):
        kube.create_namespace(ns)
    sets = ["--set", "webhook.enabled=false", "--set", f"agent.namespaces={{{serving}}}",
            "--set", "gateway.enabled=true", "--set", "gateway.transfer=tiny-llama",
            "--set", f"gateway.namespace={serving}",
            "--set", "gateway.inferencePool.matchLabels.kvbridge\\.io/role=decode",
            "--set", "gateway.installInferencePoolCRD=true"]  # fmt: skip
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS, *sets)
        assert kube.exists("crd", "inferencepools.inference.networking.k8s.io")
        assert not kube.exists("inferencepool", "tiny-llama", "-n", serving)
        kube.helm("upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values")
        pool = kube.get("inferencepool", "tiny-llama", "-n", serving)
        assert pool["spec"]["endpointPickerRef"] == {
            "group": "", "kind": "Service", "name": "kvbridge-epp", "port": {"number": 9002},
            "failureMode": "FailClose"}  # fmt: skip
        assert pool["spec"]["selector"] == {"matchLabels": {"kvbridge.io/role": "decode"}}
        # The API server holds pools to the CRD's schema.
        broken = {**pool, "metadata": {"name": "broken", "namespace": serving},
                  "spec": {**pool["spec"], "targetPorts": []}}  # fmt: skip
        refused = kube.kubectl("create", "-f", "-", input=json.dumps(broken), check=False)
        assert refused.returncode != 0 and "targetPorts" in refused.stderr, refused.stderr

        def can(sa: str, verb: str, resource: str) -> bool:
            return kube.kubectl("auth", "can-i", verb, resource, "-n", serving,
                                f"--as=system:serviceaccount:{serving}:{sa}",
                                check=False).stdout.strip() == "yes"  # fmt: skip
        for sa in ("kvbridge-epp", "kvbridge-agent"):
            for verb in ("get", "list", "watch"):
                assert can(sa, verb, "kvendpoints.kvbridge.io"), (sa, verb)
                assert can(sa, verb, "kvtransfers.kvbridge.io"), (sa, verb)
        for verb in ("get", "list", "watch"):   # the picker skips pairs of terminating pods
            assert can("kvbridge-epp", verb, "pods"), verb
        assert not can("kvbridge-agent", "list", "pods")   # the sidecar needs no pods
        for verb, resource in (("update", "kvtransfers.kvbridge.io"), ("delete", "pods"),
                               ("get", "secrets"), ("list", "inferencepools"),
                               ("delete", "kvendpoints.kvbridge.io")):  # fmt: skip
            assert not can("kvbridge-epp", verb, resource), (verb, resource)
    finally:
        _uninstall(kube, RELEASE, NS)
    wait_for(lambda: not kube.exists("inferencepool", "tiny-llama", "-n", serving),
             what="the InferencePool gone with the release", timeout=60, interval=1)
    assert kube.exists("crd", "inferencepools.inference.networking.k8s.io"), "CRD not kept"


# --- the operator and an agent on the chart's ServiceAccounts --------------------------------

SERVING = "serving"
WEBHOOK_HOST = f"kvbridge-webhook.{NS}.svc"


def _local_env(kube: Kube, work: Path, ports: dict[str, int]) -> dict[str, str]:
    """The installed Deployment's environment, with loopback ports and the webhook Secret's
    files standing in for the mounted volume."""
    dep = kube.get("deployment", RELEASE, "-n", NS)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    secret = kube.get("secret", "kvbridge-webhook-tls", "-n", NS)["data"]
    mount = work / "webhook-tls"
    mount.mkdir()
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (mount / key).write_bytes(base64.b64decode(secret[key]))
    assert env["KVBRIDGE_WEBHOOK_CERT"].endswith("/tls.crt")
    assert env["KVBRIDGE_WEBHOOK_KEY"].endswith("/tls.key")
    env.update(
        {
            "POD_NAME": "kvbridge-chart-test",
            "POD_NAMESPACE": NS,
            "KVBRIDGE_METRICS_PORT": str(ports["metrics"]),
            "KVBRIDGE_METRICS_ADDR": "127.0.0.1",
            "KVBRIDGE_WEBHOOK_PORT": str(ports["webhook"]),
            "KVBRIDGE_WEBHOOK_ADDR": "127.0.0.1",
            "KVBRIDGE_WEBHOOK_CERT": str(mount / "tls.crt"),
            "KVBRIDGE_WEBHOOK_KEY": str(mount / "tls.key"),
            "KVBRIDGE_DEBOUNCE": "0.1",
        }
    )
    return env


def _agent_user(pod: str) -> dict[str, Any]:
    """``request.userInfo`` of an agent authenticated with a token bound to ``pod``."""
    return {
        "username": "system:serviceaccount:serving:kvbridge-agent",
        "extra": {"authentication.kubernetes.io/pod-name": [pod]},
    }


def _review(
    port: int, ca: Path, path: str, obj: dict[str, Any], user: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Send an AdmissionReview the way the API server would: TLS verified against the chart's
    caBundle for the webhook Service's DNS name, to the path the chart configured."""
    ctx = ssl.create_default_context(cafile=str(ca))
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "chart-test",
            "operation": "CREATE",
            "object": obj,
            "oldObject": None,
            "kind": {"group": "kvbridge.io", "version": "v1alpha1", "kind": obj["kind"]},
            "resource": {
                "group": "kvbridge.io",
                "version": "v1alpha1",
                "resource": f"{obj['kind'].lower()}s",
            },
            "namespace": SERVING,
            "name": obj["metadata"]["name"],
            "dryRun": False,
            "userInfo": user or _agent_user(obj["metadata"]["name"]),
        },
    }
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=WEBHOOK_HOST) as tls,
    ):
        conn = http.client.HTTPConnection(WEBHOOK_HOST)
        conn.sock = tls
        conn.request("POST", path, json.dumps(review), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())["response"]


def _deployment_operator(kube: Kube, work: Path, ports: dict[str, int]) -> Any:
    """An ``OperatorProcess`` that runs the installed Deployment's own command line (scope and
    namespace flags included), with the liveness endpoint moved to a loopback port; ready once
    live (the test calls the webhook itself)."""
    from kvbridge_testkit.operator_process import OperatorProcess

    dep = kube.get("deployment", RELEASE, "-n", NS)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["kopf", "run"], command
    liveness = f"--liveness=http://127.0.0.1:{ports['liveness']}/healthz"
    args = [liveness if a.startswith("--liveness=") else a for a in command[2:]]
    return OperatorProcess(
        kube.token_kubeconfig(NS, "kvbridge"), work, _local_env(kube, work, ports), ports,
        args=args, wait_webhook=False,
    )


SCOPES = {
    "cluster": {"agent": {"namespaces": [SERVING]}},
    "namespaced": {
        "operator": {"scope": "namespaced", "watchNamespaces": [SERVING]},
        "agent": {"namespaces": [SERVING]},
    },
}


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_operator_reconciles_with_the_chart_service_account(
    kube: Kube, tmp_path: Path, scope: str
) -> None:
    """The Deployment's kopf command run as a separate process with only the chart's operator
    ServiceAccount token, and agents with only the chart's agent token, take a topology to
    Ready; the webhook serves the chart's certificate at the chart's paths."""
    from kvbridge_operator import testing as manifests
    from kvbridge_operator.config import ENDPOINTS, TRANSFERS
    from kvbridge_testkit import cluster as kc
    from kvbridge_testkit.e2e import Api

    for ns in (NS, SERVING):
        kube.create_namespace(ns)
    values = tmp_path / "values.yaml"
    # The API server cannot reach Services here (no kube-proxy): keep it from calling the
    # webhook, which this test calls directly instead.
    values.write_text(
        yaml.safe_dump(
            {
                **SCOPES[scope],
                "webhook": {"namespaceSelector": {"matchLabels": {"kvbridge.io/webhook": "on"}}},
            }
        )
    )
    op: Any = None
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(values))
        ports = {k: kc.free_port() for k in ("metrics", "liveness", "webhook")}
        work = tmp_path / "operator"
        work.mkdir()
        op = _deployment_operator(kube, work, ports)
        assert op.env["KVBRIDGE_LEASE_NAME"] == "kvbridge-operator"  # the chart's Role names it
        with kc.FakeKubelet(kube.cluster.api_client(), {"node-a": {}}):
            op.start()
            admin = Api(kube.cluster.api_client())
            agent = Api(kube.cluster.api_client(kube.token_kubeconfig(SERVING, "kvbridge-agent")))
            admin.create_transfer(SERVING, prefill_tp=2, decode_tp=1)
            engines = {"p0": ("prefill", 2), "d0": ("decode", 1), "d1": ("decode", 1)}
            for engine, (role, tp) in engines.items():
                for rank in range(tp):
                    name = f"{engine}-{rank}"
                    admin.core.create_namespaced_pod(
                        SERVING,
                        {
                            "metadata": {"name": name, "labels": {"kvbridge.io/agent": "true"}},
                            "spec": {
                                "serviceAccountName": "kvbridge-agent",
                                "containers": [{"name": "vllm", "image": "vllm:fake"}],
                            },
                        },
                    )
                    pod = wait_for(
                        lambda n=name: admin._running(SERVING, n), what=f"pod {name} running"
                    )
                    # The agent publishes its own endpoint, owned by its pod.
                    agent.create(
                        ENDPOINTS,
                        SERVING,
                        manifests.endpoint_manifest(
                            name,
                            role=role,
                            engine_id=engine,
                            tp_rank=rank,
                            tp_size=tp,
                            host=pod.status.pod_ip,
                            pod={"name": name, "uid": pod.metadata.uid},
                        ),
                    )
            admin.wait_condition(SERVING, "Paired", "True")
            # The examples are accepted by this API server (CRD schema, Deployment).
            kube.kubectl(
                "apply",
                "--dry-run=server",
                "-n",
                SERVING,
                "-f",
                str(REPO / "examples" / "kvtransfer.yaml"),
                "-f",
                str(REPO / "examples" / "agent-pod.yaml"),
            )

            # Decode agents read their own endpoint (get only) and report their handshakes.
            for name in ("d0-0", "d1-0"):
                peers = wait_for(
                    lambda n=name: (agent.endpoint(SERVING, n).get("status") or {}).get("peers"),
                    what=f"{name} peers",
                )
                agent.patch_status(
                    ENDPOINTS,
                    SERVING,
                    name,
                    {"handshakes": [manifests.handshake(p["name"], p["epoch"]) for p in peers]},
                )
            admin.wait_condition(SERVING, "Ready", "True", reason="AllPairsVerified")
            assert admin.endpoint(SERVING, "p0-0")["status"]["state"] == "Paired"
            with pytest.raises(ApiException) as denied:
                agent.list(ENDPOINTS, SERVING)
            assert denied.value.status == 403

            # The admission webhook, with the chart's certificate, at the chart's paths.
            (vwc,) = kube.get(
                "validatingwebhookconfigurations", f"-l=app.kubernetes.io/instance={RELEASE}"
            )["items"]
            paths = {
                w["rules"][0]["resources"][0]: w["clientConfig"]["service"]["path"]
                for w in vwc["webhooks"]
            }
            ca = work / "webhook-tls" / "ca.crt"
            ok = manifests.endpoint_manifest("d9-0", role="decode", engine_id="d9")
            assert _review(ports["webhook"], ca, paths[ENDPOINTS], ok)["allowed"] is True
            bad = manifests.endpoint_manifest(
                "d9-0", role="decode", engine_id="d9", tp_rank=3, tp_size=2
            )
            verdict = _review(ports["webhook"], ca, paths[ENDPOINTS], bad)
            assert verdict["allowed"] is False and "spec.tpRank" in verdict["status"]["message"]
            # ... and only the owning pod may write an endpoint.
            theft = _review(ports["webhook"], ca, paths[ENDPOINTS], ok, _agent_user("d0-0"))
            assert theft["allowed"] is False
            assert "owner Pod 'd9-0'" in theft["status"]["message"]
            kvt = manifests.transfer_manifest("kvt", SERVING)
            assert _review(ports["webhook"], ca, paths[TRANSFERS], kvt)["allowed"] is True

            # Deletion runs the finalizer handler under the same token.
            admin.delete(TRANSFERS, SERVING, "kvt")
            wait_for(lambda: not admin.list(TRANSFERS, SERVING), what="KVTransfer deleted")
            assert (
                "kvbridge_reconciles_total"
                in urllib.request.urlopen(op.metrics_url, timeout=5).read().decode()
            )
            log = op.log()
            assert "Traceback" not in log, log[-4000:]
            denials = [
                line
                for line in log.splitlines()
                if "Forbidden" in line or "Not enough permissions" in line
            ]
            assert not denials, "\n".join(denials)
            op.stop()
            for name in ("p0-0", "p0-1", "d0-0", "d1-0"):
                admin.core.delete_namespaced_pod(name, SERVING)
            wait_for(
                lambda: not admin.core.list_namespaced_pod(SERVING).items, what="serving pods gone"
            )
            # The agent made each pod its endpoint's owner: the garbage collector cleans up.
            wait_for(
                lambda: not admin.list(ENDPOINTS, SERVING),
                timeout=60,
                what="KVEndpoints garbage-collected with their pods",
            )
    finally:
        if op is not None:
            op.stop()
        _uninstall(kube, RELEASE, NS)
