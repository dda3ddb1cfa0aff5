"""Offline checks of charts/kvbridge: lint, rendering over several values files, Kubernetes
schema validation of every object, the values schema, the CRD copy, RBAC and security."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chartlib import (
    CHART,
    CRD_KINDS,
    K8S_120_KINDS,
    NAMESPACE,
    NEWER_KINDS,
    REPO,
    HelmError,
    Rule,
    by_kind,
    expand_rules,
    helm,
    iter_containers,
    needs_helm,
    one,
    render,
    values_file,
    values_files,
)

pytestmark = needs_helm

# The oldest schema set kubernetes-validate ships; the chart itself targets >= 1.20 (checked
# separately against K8S_120_KINDS).
VALIDATE_AS = "1.25.0"
VALUES = values_files()
INFERENCE_API = "inference.networking.k8s.io/v1"
# Values files of setups that need more than the chart's floor: the Kubernetes version and the
# extra APIs their pretend cluster serves (the gateway's gRPC probes need 1.24).
CLUSTERS = {"gateway": ("1.29.0", (INFERENCE_API,)),
            "pair-choice": ("1.29.0", (INFERENCE_API,))}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every values file rendered once, as Kubernetes 1.20 would be told (or the cluster
    CLUSTERS names)."""
    out = {}
    for name in VALUES:
        kube, apis = CLUSTERS.get(name, ("1.20.2", ()))
        out[name] = render(name, kube_version=kube, api_versions=apis)
    return out


def test_values_files_cover_the_required_setups() -> None:
    assert {
        "defaults",
        "cluster-wide",
        "namespaced",
        "cert-manager",
        "networkpolicy-servicemonitor",
    } <= set(VALUES)


@pytest.mark.parametrize("name", VALUES)
def test_lint_strict(name: str) -> None:
    out = helm("lint", "--strict", str(CHART), "-f", str(values_file(name)))
    assert "0 chart(s) failed" in out


def test_crds_are_identical_to_the_source() -> None:
    src = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    dst = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert src, "crds/ holds no CRDs"
    assert sorted(dst) == sorted(src), "charts/kvbridge/crds/ has other files than crds/"
    drifted = [n for n in src if src[n] != dst[n]]
    assert not drifted, f"chart CRDs drifted from crds/: {drifted}; run charts/sync-crds.sh"
    proc = subprocess.run(
        [str(REPO / "charts" / "sync-crds.sh"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def _validate_k8s(obj: dict[str, Any]) -> None:
    if (obj["apiVersion"], obj["kind"]) == ("policy/v1beta1", "PodDisruptionBudget"):
        # What the chart renders for Kubernetes < 1.21 (maxUnavailable or minAvailable, and a
        # selector) means the same in policy/v1, as far back as kubernetes-validate goes.
        obj = {**obj, "apiVersion": "policy/v1"}
    try:
        kubernetes_validate.validate(obj, VALIDATE_AS, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        raise AssertionError(f"{where}: {path}: {e.message}") from None


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """openAPIV3Schema per (apiVersion, kind): of crds/ and of the CRDs the templates install
    (the InferencePool's)."""
    crds = [c for path in sorted((CHART / "crds").glob("*.yaml"))
            for c in yaml.safe_load_all(path.read_text()) if c]  # fmt: skip
    crds += by_kind(render(sets=["gateway.installInferencePoolCRD=true"]),
                    "CustomResourceDefinition")  # fmt: skip
    out = {}
    for crd in crds:
        spec = crd["spec"]
        for v in spec["versions"]:
            out[(f"{spec['group']}/{v['name']}", spec["names"]["kind"])] = v["schema"][
                "openAPIV3Schema"
            ]
    return out


def _check_integration_object(obj: dict[str, Any]) -> None:
    """Objects of CRDs we do not ship (cert-manager, prometheus-operator): the fields we rely on."""
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "Certificate":
        assert spec["secretName"] and spec["dnsNames"] and spec["issuerRef"]["name"]
        assert spec["issuerRef"]["kind"] in {"Issuer", "ClusterIssuer"}
    elif kind == "Issuer":
        assert spec == {"selfSigned": {}}
    elif kind == "ServiceMonitor":
        assert spec["selector"]["matchLabels"] and spec["endpoints"][0]["port"] == "metrics"
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}


@pytest.mark.parametrize("name", VALUES)
def test_every_object_validates_strictly(name: str, rendered: dict) -> None:
    crd_schemas = _crd_schemas()
    objs = rendered[name]
    assert objs
    kube = tuple(int(n) for n in CLUSTERS.get(name, ("1.20.2",))[0].split(".")[:2])
    newer = {k for k, since in NEWER_KINDS.items() if kube >= since}
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        assert key in K8S_120_KINDS | CRD_KINDS | newer, \
            f"{key} is not served by Kubernetes 1.20 (nor by {kube}, where rendered for it)"
        if key in K8S_120_KINDS | newer:
            _validate_k8s(obj)
        elif key in crd_schemas:
            jsonschema.validate(obj, crd_schemas[key])
        else:
            _check_integration_object(obj)
        if obj["kind"] not in {
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "ValidatingWebhookConfiguration",
        }:
            assert obj["metadata"].get("namespace"), f"{key} {obj['metadata']['name']}: namespace"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_included_crds_validate_strictly() -> None:
    crds = [o for o in render(include_crds=True) if o["kind"] == "CustomResourceDefinition"]
    assert {c["metadata"]["name"] for c in crds} >= {
        "kvtransfers.kvbridge.io",
        "kvendpoints.kvbridge.io",
    }
    for crd in crds:
        _validate_k8s(crd)


def test_kubernetes_validate_rejects_bad_types() -> None:
    """The validator is really strict: a wrong type and an unknown field are both refused."""
    objs = render()
    dep = json.loads(json.dumps(one(objs, "Deployment")))
    dep["spec"]["replicas"] = "one"
    with pytest.raises(AssertionError, match="replicas"):
        _validate_k8s(dep)
    dep = json.loads(json.dumps(one(objs, "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolice"):
        _validate_k8s(dep)


# --- values schema --------------------------------------------------------------------------

BAD_VALUES = [
    (["operator.replicas=-1"], "/operator/replicas"),
    (["operator.replicas=one"], "/operator/replicas': got string, want integer"),
    (["operator.leaderElection.leaseDurationSeconds=7.5"],
     "/operator/leaderElection/leaseDurationSeconds"),
    (["operator.leaderElection.retryPeriodSeconds=0"],
     "/operator/leaderElection/retryPeriodSeconds"),
    (["operator.podDisruptionBudget.minAvailable=half"], "/operator/podDisruptionBudget"),
    # kopf peering is gone (leader election replaced it): its old values are refused by name.
    (["operator.peering.enabled=false"], "additional properties 'peering' not allowed"),
    (["operator.scope=global"], "'cluster', 'namespaced'"),
    (["operator.logLevel=verbose"], "/operator/logLevel"),
    (["operator.watchNamespaces={Team_A}"], "/operator/watchNamespaces/0"),
    (["image.pullPolicy=Sometimes"], "'Always', 'IfNotPresent', 'Never'"),
    (["image.digest=latest"], "/image/digest"),
    (["webhook.failurePolicy=fail"], "'Fail', 'Ignore'"),
    (["webhook.timeoutSeconds=60"], "/webhook/timeoutSeconds"),
    (["webhook.certs.source=vault"], "/webhook/certs/source"),
    (["webhook.certs.source=secret"], "/webhook/certs/secret/name"),
    (["webhook.certs.certManager.duration=90d"], "/webhook/certs/certManager/duration"),
    (["metrics.port=70000"], "/metrics/port"),
    (["networkPolicy.sideChannelPort=0"], "/networkPolicy/sideChannelPort"),
    (["networkPolicy.peerPorts[0].port=13337"], "/networkPolicy/peerPorts"),
    (["serviceAccount.create=false"], "/serviceAccount/name"),
    (["operator.loglevel=debug"], "additional properties 'loglevel' not allowed"),
    (["replicaCount=3"], "additional properties 'replicaCount' not allowed"),
]


@pytest.mark.parametrize(("sets", "fragment"), BAD_VALUES, ids=[s[0][0] for s in BAD_VALUES])
def test_schema_rejects_bad_values(sets: list[str], fragment: str) -> None:
    with pytest.raises(HelmError) as err:
        render(sets=sets)
    msg = str(err.value)
    assert "don't meet the specifications of the schema" in msg
    assert fragment in msg, msg


# Values that are Kubernetes structs passed through as a whole: one comment covers the block.
K8S_STRUCTS = {
    "operator.resources",
    "router.resources",
    "gateway.resources",
    "operator.livenessProbe",
    "operator.readinessProbe",
    "networkPolicy.podSelector",
    "networkPolicy.peerSelector",
}


def test_schema_describes_every_value() -> None:
    """values.yaml and values.schema.json agree key for key, and every key has a description
    in the schema and a comment in values.yaml."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = (CHART / "values.yaml").read_text().splitlines()

    def walk(node: dict[str, Any], sch: dict[str, Any], path: str) -> None:
        for key, val in node.items():
            where = f"{path}{key}"
            assert key in sch.get("properties", {}), f"{where} missing from values.schema.json"
            sub = sch["properties"][key]
            if isinstance(val, dict) and "properties" in sub and where not in K8S_STRUCTS:
                walk(val, sub, f"{where}.")
            else:
                assert sub.get("description"), f"{where}: no description in the schema"
                assert _commented(text, key, val), f"{where}: no comment in values.yaml"

    walk(values, schema, "")


def _commented(lines: list[str], key: str, value: Any) -> bool:
    """Some line `key:` in values.yaml is directly preceded by a comment line."""
    pat = re.compile(rf"^\s*{re.escape(key)}:")
    for i, line in enumerate(lines):
        if pat.match(line) and i > 0 and lines[i - 1].strip().startswith("#"):
            return True
    return False


# --- RBAC -----------------------------------------------------------------------------------


def _roles(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return by_kind(objs, "Role") + by_kind(objs, "ClusterRole")


@pytest.mark.parametrize("name", VALUES)
def test_rbac_has_no_wildcards(name: str, rendered: dict) -> None:
    for role in _roles(rendered[name]):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{role['metadata']['name']}: {rule}"
            assert not any(r.endswith("/*") for r in rule.get("resources", [])), rule


# The operator's own RBAC manifest: the one list of what the operator uses.
OPERATOR_MANIFEST = REPO / "hack" / "operator-rbac.yaml"
CLUSTER_SCOPED = {"nodes", "customresourcedefinitions", "namespaces"}
KOPF_NAMESPACED_EXTRA = {Rule("", "namespaces", v) for v in ("list", "watch")}
LEASE_GROUP = "coordination.k8s.io"
AGENT = {
    *(Rule("kvbridge.io", "kvendpoints", v) for v in ("create", "get", "update", "patch")),
    *(Rule("kvbridge.io", "kvendpoints/status", v) for v in ("get", "update", "patch")),
    *(Rule("kvbridge.io", "kvtransfers", v) for v in ("get", "list", "watch")),
}


def _manifest_rules(*, leases: bool = False) -> set[Rule]:
    """The manifest's rules: those on the watched objects, or (``leases``) the Lease's, which
    the chart grants apart, in the release namespace."""
    docs = [d for d in yaml.safe_load_all(OPERATOR_MANIFEST.read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    rules = [r for r in role["rules"] if (LEASE_GROUP in r["apiGroups"]) == leases]
    return expand_rules(rules, named=leases)


def _operator_roles(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's roles on the objects it watches (the leader election's Role aside)."""
    return [
        r
        for r in _roles(objs)
        if r["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
        and not r["metadata"]["name"].endswith("-leader-election")
    ]


def test_operator_rbac_cluster_scope() -> None:
    """Cluster scope grants the operator's manifest (less the Lease rules) in one
    ClusterRole."""
    manifest = _manifest_rules()
    objs = render("defaults")
    (role,) = _operator_roles(objs)
    assert role["kind"] == "ClusterRole"
    assert expand_rules(role["rules"]) == manifest
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvbridge", "namespace": NAMESPACE}
    ]


def test_operator_rbac_namespaced_scope(rendered: dict) -> None:
    """Namespaced scope: the manifest's namespaced rules in a Role per watched namespace, only
    the cluster-scoped reads in a ClusterRole, plus the namespace list/watch that kopf needs
    in namespaced mode only (the manifest describes the cluster-wide operator)."""
    manifest = _manifest_rules() | KOPF_NAMESPACED_EXTRA
    objs = rendered["namespaced"]
    roles = _operator_roles(objs)
    ns_roles = {r["metadata"]["namespace"]: r for r in roles if r["kind"] == "Role"}
    assert sorted(ns_roles) == ["team-a", "team-b"]
    for role in ns_roles.values():
        assert expand_rules(role["rules"]) == {
            r for r in manifest if r.resource not in CLUSTER_SCOPED
        }
    (cluster_role,) = [r for r in roles if r["kind"] == "ClusterRole"]
    assert expand_rules(cluster_role["rules"]) == {
        r for r in manifest if r.resource in CLUSTER_SCOPED
    }
    bindings = [b for b in by_kind(objs, "RoleBinding") if b["roleRef"]["name"] == "kvbridge"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == NAMESPACE


@pytest.mark.parametrize("name", ["defaults", "namespaced", "cluster-wide"])
def test_leader_election_rbac_is_the_lease_only(name: str, rendered: dict) -> None:
    """Whatever the scope, a Role in the release namespace lets the operator create a Lease
    and get and update its own (the manifest's rules, for the chart's Lease name), bound to
    the operator's ServiceAccount; nothing else on Leases anywhere."""
    objs = rendered[name]
    lease = "kvbridge-prod" if name == "cluster-wide" else "kvbridge-operator"
    role = one(objs, "Role", "kvbridge-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    expected = {Rule(r.group, r.resource.replace("kvbridge-operator", lease), r.verb)
                for r in _manifest_rules(leases=True)}  # fmt: skip
    assert expand_rules(role["rules"], named=True) == expected
    binding = one(objs, "RoleBinding", "kvbridge-leader-election")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "kvbridge-leader-election"}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvbridge",
                                    "namespace": NAMESPACE}]  # fmt: skip
    for other in _operator_roles(objs):
        assert not any(LEASE_GROUP in r["apiGroups"] for r in other["rules"]), other
    assert _env(objs)["KVBRIDGE_LEASE_NAME"] == lease
    assert not by_kind(rendered["minimal"], "Role") or not [
        r for r in by_kind(rendered["minimal"], "Role")
        if r["metadata"]["name"].endswith("-leader-election")
    ]


def test_namespaced_scope_defaults_to_the_release_namespace() -> None:
    objs = render(sets=["operator.scope=namespaced"])
    (role,) = [r for r in _operator_roles(objs) if r["kind"] == "Role"]
    assert role["metadata"]["namespace"] == NAMESPACE
    cmd = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--namespace={NAMESPACE}" in cmd and "--all-namespaces" not in cmd


@pytest.mark.parametrize("name", VALUES)
def test_agent_rbac_is_exactly_endpoint_publishing(name: str, rendered: dict) -> None:
    objs = rendered[name]
    agent_roles = [
        r for r in _roles(objs) if r["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
    ]
    assert all(r["kind"] == "Role" for r in agent_roles)
    for role in agent_roles:
        assert expand_rules(role["rules"]) == AGENT


def test_e2e_agent_rbac_is_the_charts(rendered: dict) -> None:
    """The e2e tests and the demo grant agents kvbridge_testkit.sim.AGENT_RULES without
    installing the chart; they must be exactly the chart's agent Role, or those tests prove
    nothing."""
    from kvbridge_testkit.sim import AGENT_RULES

    assert expand_rules(AGENT_RULES) == AGENT


def test_agent_objects_per_namespace(rendered: dict) -> None:
    objs = rendered["cluster-wide"]
    sas = {
        (s["metadata"]["namespace"], s["metadata"]["name"]) for s in by_kind(objs, "ServiceAccount")
    }
    assert {("serving-a", "kvbridge-agent"), ("serving-b", "kvbridge-agent")} <= sas
    for ns in ("serving-a", "serving-b"):
        rb = one(
            [b for b in by_kind(objs, "RoleBinding") if b["metadata"]["namespace"] == ns],
            "RoleBinding",
        )
        assert rb["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "kvbridge-agent",
        }
        assert [s["name"] for s in rb["subjects"]] == ["kvbridge-agent", "vllm"]
        assert {s["namespace"] for s in rb["subjects"]} == {ns}
    assert not _roles(rendered["minimal"]) or all(
        r["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
        for r in _roles(rendered["minimal"])
    )


# --- Deployment -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUES)
def test_containers_are_locked_down(name: str, rendered: dict) -> None:
    objs = rendered[name]
    for dep in by_kind(objs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in iter_containers(objs):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        if c["name"] == "router":
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
            continue
        if c["name"] == "epp":
            assert c["readinessProbe"]["grpc"]["service"] == "readiness"
            assert c["livenessProbe"]["grpc"]["service"] == "liveness"
            continue
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def _command(objs: list[dict[str, Any]]) -> list[str]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]


def test_operator_command_line(rendered: dict) -> None:
    cmd = _command(rendered["defaults"])
    assert cmd[:3] == ["kopf", "run", "--module=kvbridge_operator.main"]
    assert "--all-namespaces" in cmd and not [a for a in cmd if a.startswith("--priority")]
    assert "--liveness=http://0.0.0.0:8080/healthz" in cmd
    assert not {"--debug", "--quiet"} & set(cmd)

    cmd = _command(rendered["namespaced"])
    assert [a for a in cmd if a.startswith("--namespace=")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "--quiet" in cmd and "--all-namespaces" not in cmd

    cmd = _command(rendered["cluster-wide"])
    assert {"--debug", "--log-format=json", "--log-refkey=kvbridge"} <= set(cmd)
    assert _env(rendered["cluster-wide"])["KVBRIDGE_KOPF_LOG_LEVEL"] == "DEBUG"
    assert "KVBRIDGE_KOPF_LOG_LEVEL" not in _env(rendered["defaults"])


def _env(objs: list[dict[str, Any]]) -> dict[str, str]:
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in c["env"]}


def test_operator_settings_match_the_operator() -> None:
    """Every KVBRIDGE_* variable the chart sets is one the operator reads."""
    config = (REPO / "operator" / "kvbridge_operator" / "config.py").read_text()
    env = _env(render())
    assert env["KVBRIDGE_METRICS_PORT"] == "9090" and env["KVBRIDGE_WEBHOOK_PORT"] == "9443"
    assert env["KVBRIDGE_WEBHOOK_CERT"] == "/etc/kvbridge/webhook-tls/tls.crt"
    for name in env:
        if name.startswith("KVBRIDGE_"):
            assert f'"{name}"' in config, f"{name} is not read by kvbridge_operator.config"
    assert _env(render("minimal"))["KVBRIDGE_WEBHOOK_PORT"] == "0"
    assert _env(render("minimal"))["KVBRIDGE_METRICS_PORT"] == "0"


def test_webhook_paths_are_the_operator_handler_ids() -> None:
    from kvbridge_operator.webhook import WEBHOOKS

    vwc = one(render(), "ValidatingWebhookConfiguration")
    paths = {
        w["rules"][0]["resources"][0]: w["clientConfig"]["service"]["path"] for w in vwc["webhooks"]
    }
    assert paths == {plural: f"/{hook_id}" for hook_id, plural in WEBHOOKS.items()}


def test_operator_replicas_lead_through_a_lease(rendered: dict) -> None:
    """Two replicas by default, each named in the Lease after its pod, the chart's timing
    handed to the operator, rolling updates that never take the last pod (a stopping leader
    releases the Lease), a PodDisruptionBudget and a soft spread over nodes."""
    objs = rendered["defaults"]
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # kopf's identity: without POD_ID it asks the OS for a user name the non-root UID lacks.
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    values = _env(objs)
    assert {k: values[k] for k in values if "LEASE" in k or "LEADER" in k} == {
        "KVBRIDGE_LEADER_ELECTION": "true",
        "KVBRIDGE_LEASE_NAME": "kvbridge-operator",
        "KVBRIDGE_LEASE_DURATION": "15",
        "KVBRIDGE_LEASE_RENEW_DEADLINE": "10",
        "KVBRIDGE_LEASE_RETRY_PERIOD": "2",
    }
    selector = dep["spec"]["selector"]["matchLabels"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1beta1"  # rendered for Kubernetes 1.20
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": selector}}
    # The webhook Service selects every replica: standbys serve admission too.
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "kvbridge-webhook"]
    assert svc["spec"]["selector"] == selector

    wide = rendered["cluster-wide"]
    assert one(wide, "Deployment")["spec"]["replicas"] == 3
    assert one(wide, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    assert {k: v for k, v in _env(wide).items() if k.startswith("KVBRIDGE_LEASE_")} == {
        "KVBRIDGE_LEASE_NAME": "kvbridge-prod", "KVBRIDGE_LEASE_DURATION": "30",
        "KVBRIDGE_LEASE_RENEW_DEADLINE": "20", "KVBRIDGE_LEASE_RETRY_PERIOD": "4"}
    assert one(render(kube_version="1.29.0"), "PodDisruptionBudget")["apiVersion"] == "policy/v1"


def test_one_replica_or_none_needs_no_budget_and_no_election() -> None:
    """One replica: no PDB (it would block every drain) and no anti-affinity; leader election
    off is allowed only up to one replica (every replica would act), and then the Deployment
    recreates its pod instead of rolling."""
    one_pod = render(sets=["operator.replicas=1"])
    assert not by_kind(one_pod, "PodDisruptionBudget")
    assert "affinity" not in one(one_pod, "Deployment")["spec"]["template"]["spec"]
    alone = render(sets=["operator.replicas=1", "operator.leaderElection.enabled=false"])
    dep = one(alone, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert _env(alone)["KVBRIDGE_LEADER_ELECTION"] == "false"
    assert "KVBRIDGE_LEASE_NAME" not in _env(alone)
    assert not [r for r in by_kind(alone, "Role") if r["metadata"]["name"].endswith("-election")]
    custom = render(sets=["operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
                          "Execution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
                          "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
                          "Execution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists"])
    assert set(one(custom, "Deployment")["spec"]["template"]["spec"]["affinity"]) == {
        "nodeAffinity"}  # operator.affinity replaces the default spread


@pytest.mark.parametrize(("sets", "fragment"), [
    (["operator.leaderElection.enabled=false"], "operator.replicas > 1 needs"),
    (["operator.leaderElection.renewDeadlineSeconds=15"],
     "renewDeadlineSeconds must be less than leaseDurationSeconds"),
    (["operator.leaderElection.retryPeriodSeconds=10"],
     "retryPeriodSeconds must be less than renewDeadlineSeconds"),
])  # fmt: skip
def test_inconsistent_leader_election_values_fail(sets: list[str], fragment: str) -> None:
    with pytest.raises(HelmError, match=re.escape(fragment)):
        render(sets=sets)


def test_image_reference() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"ghcr.io/kvbridge/kvbridge-operator:{chart['appVersion']}"
    image = one(render(sets=["image.tag=dev"]), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]
    assert image.endswith(":dev")
    objs = render("cluster-wide")
    image = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("ghcr.io/kvbridge/kvbridge-operator@sha256:")


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"].startswith(">=1.20")
    with pytest.raises(HelmError, match="kubeVersion"):
        render(kube_version="1.19.0")


# --- webhook --------------------------------------------------------------------------------


def _openssl_text(pem: bytes) -> str:
    return subprocess.run(
        ["openssl", "x509", "-noout", "-text"], input=pem, capture_output=True, check=True
    ).stdout.decode()


def test_generated_webhook_certificate(rendered: dict, tmp_path: Path) -> None:
    objs = rendered["defaults"]
    secret = one(objs, "Secret", "kvbridge-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    vwc = one(objs, "ValidatingWebhookConfiguration")
    ca = secret["data"]["ca.crt"]
    assert all(w["clientConfig"]["caBundle"] == ca for w in vwc["webhooks"])
    cert = _openssl_text(base64.b64decode(secret["data"]["tls.crt"]))
    for dns in (
        "kvbridge-webhook",
        f"kvbridge-webhook.{NAMESPACE}",
        f"kvbridge-webhook.{NAMESPACE}.svc",
    ):
        assert f"DNS:{dns}" in cert
    # The serving certificate is signed by the CA in the bundle.
    with_ca = tmp_path / "ca.pem"
    with_ca.write_bytes(base64.b64decode(ca))
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(with_ca)],
        input=base64.b64decode(secret["data"]["tls.crt"]),
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_webhook_configuration(rendered: dict) -> None:
    vwc = one(rendered["defaults"], "ValidatingWebhookConfiguration")
    plurals = set()
    for w in vwc["webhooks"]:
        (rule,) = w["rules"]
        assert rule["apiGroups"] == ["kvbridge.io"] and rule["apiVersions"] == ["v1alpha1"]
        assert rule["operations"] == ["CREATE", "UPDATE"]
        plurals.update(rule["resources"])
        svc = w["clientConfig"]["service"]
        assert (svc["name"], svc["namespace"], svc["port"]) == ("kvbridge-webhook", NAMESPACE, 443)
        assert w["failurePolicy"] == "Fail" and w["sideEffects"] == "None"
        assert "namespaceSelector" not in w
    assert plurals == {"kvtransfers", "kvendpoints"}

    ns_vwc = one(rendered["namespaced"], "ValidatingWebhookConfiguration")
    assert ns_vwc["metadata"]["name"] == f"kvbridge-{NAMESPACE}"
    assert {w["failurePolicy"] for w in ns_vwc["webhooks"]} == {"Ignore"}
    # Kubernetes 1.20 has no kubernetes.io/metadata.name label; 1.21+ does.
    assert all("namespaceSelector" not in w for w in ns_vwc["webhooks"])
    newer = one(render("namespaced", kube_version="1.25.0"), "ValidatingWebhookConfiguration")
    for w in newer["webhooks"]:
        assert w["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
        ]


def test_cert_manager_certificates(rendered: dict) -> None:
    objs = rendered["cert-manager"]
    assert not by_kind(objs, "Secret"), "cert-manager writes the Secret, the chart must not"
    cert = one(objs, "Certificate")
    issuer = one(objs, "Issuer")
    assert cert["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    assert cert["spec"]["secretName"] == "kvbridge-webhook-tls"
    assert f"kvbridge-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{cert['metadata']['name']}"
    )
    assert all("caBundle" not in w["clientConfig"] for w in vwc["webhooks"])
    dep = one(objs, "Deployment")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["webhook-tls"]["secret"]["secretName"] == "kvbridge-webhook-tls"

    objs = rendered["cert-manager-issuer"]
    assert not by_kind(objs, "Issuer")
    assert one(objs, "Certificate")["spec"]["issuerRef"] == {
        "name": "internal-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_own_certificate_secret() -> None:
    bundle = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n...").decode()
    objs = render(
        sets=[
            "webhook.certs.source=secret",
            "webhook.certs.secret.name=my-tls",
            f"webhook.certs.secret.caBundle={bundle}",
        ]
    )
    assert not by_kind(objs, "Secret") and not by_kind(objs, "Certificate")
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert {w["clientConfig"]["caBundle"] for w in vwc["webhooks"]} == {bundle}
    vols = one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": "my-tls", "defaultMode": 0o440}} in vols


def test_webhook_disabled(rendered: dict) -> None:
    objs = rendered["minimal"]
    assert not by_kind(objs, "ValidatingWebhookConfiguration")
    assert not by_kind(objs, "Secret")
    assert [s["metadata"]["name"] for s in by_kind(objs, "Service")] == []
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in c["ports"]] == ["health"]


# --- metrics and NetworkPolicy --------------------------------------------------------------


def test_metrics_service_and_servicemonitor(rendered: dict) -> None:
    objs = rendered["networkpolicy-servicemonitor"]
    svc = one(objs, "Service", "kvbridge-metrics")
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    sm = one(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert all(
        svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items()
    )
    assert not by_kind(rendered["defaults"], "ServiceMonitor")


def test_networkpolicy(rendered: dict) -> None:
    assert not by_kind(rendered["defaults"], "NetworkPolicy")
    pol = one(rendered["networkpolicy-servicemonitor"], "NetworkPolicy")
    spec = pol["spec"]
    assert spec["podSelector"] == {"matchLabels": {"kvbridge.io/agent": "true"}}
    assert spec["policyTypes"] == ["Ingress"]
    peers, open_ports, extra = spec["ingress"]
    assert peers["from"] == [{"podSelector": {"matchLabels": {"kvbridge.io/agent": "true"}}}]
    assert peers["ports"] == [{"port": 5600, "protocol": "TCP"}, {"port": 13337, "protocol": "TCP"}]
    assert "from" not in open_ports
    assert open_ports["ports"] == [
        {"port": 8000, "protocol": "TCP"},
        {"port": "metrics", "protocol": "TCP"},
    ]
    assert extra["ports"] == [{"port": 9100, "protocol": "TCP"}]
    # Default: peers reach every port (UCX picks data-plane ports at run time).
    pol = one(render(sets=["networkPolicy.enabled=true"]), "NetworkPolicy")
    assert "ports" not in pol["spec"]["ingress"][0]


# --- examples -------------------------------------------------------------------------------


def test_examples_fit_the_chart() -> None:
    """examples/ validate (Kubernetes schema, our CRD schema) and use what the chart grants."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (kvt,) = yaml.safe_load_all((REPO / "examples" / "kvtransfer.yaml").read_text())
    jsonschema.validate(kvt, _crd_schemas()[("kvbridge.io/v1alpha1", "KVTransfer")])
    assert kvt["spec"]["sideChannelPort"] == values["networkPolicy"]["sideChannelPort"]

    (dep,) = yaml.safe_load_all((REPO / "examples" / "agent-pod.yaml").read_text())
    _validate_k8s(dep)
    pod = dep["spec"]["template"]
    agent_sa = one(render(), "ServiceAccount", "kvbridge-agent")
    assert pod["spec"]["serviceAccountName"] == agent_sa["metadata"]["name"]
    for key, val in values["networkPolicy"]["podSelector"]["matchLabels"].items():
        assert pod["metadata"]["labels"][key] == val
    fields = {
        e["valueFrom"]["fieldRef"]["fieldPath"]
        for c in pod["spec"]["containers"]
        for e in c["env"]
        if "valueFrom" in e
    }
    assert {"metadata.name", "metadata.uid", "status.podIP"} <= fields


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serving_examples_load_the_connector_with_one_flag(role: str) -> None:
    """examples/serving/: valid Deployments running ``vllm serve`` with KVBridgeConnector,
    the chart's agent ServiceAccount and labels, the downward-API variables, readiness on
    /health, and pods the example KVTransfer's selector picks."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    serving = REPO / "examples" / "serving"
    (kvt,) = yaml.safe_load_all((serving / "kvtransfer.yaml").read_text())
    jsonschema.validate(kvt, _crd_schemas()[("kvbridge.io/v1alpha1", "KVTransfer")])
    (dep,) = yaml.safe_load_all((serving / f"{role}.yaml").read_text())
    _validate_k8s(dep)
    pod = dep["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == one(render(), "ServiceAccount",
                                                    "kvbridge-agent")["metadata"]["name"]
    labels = pod["metadata"]["labels"]
    for key, val in values["networkPolicy"]["podSelector"]["matchLabels"].items():
        assert labels[key] == val
    assert kvt["spec"][role]["selector"]["matchLabels"].items() <= labels.items()
    # vLLM first: kvbridge_testkit.vllm_pods.incompatible_decode edits containers[0]. Decodes
    # add the gateway's P/D sidecar (test_gateway_example_fits_the_serving_pods).
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == {"prefill": ["vllm"], "decode": ["vllm", "sidecar"]}[role]
    container = pod["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:2] == ["vllm", "serve"]
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "KVBridgeConnector",
                      "kv_connector_module_path": "kvbridge_agent.vllm", "kv_role": "kv_both",
                      "kv_buffer_device": "cpu"}
    env = {e["name"]: e for e in container["env"]}
    fields = {e["valueFrom"]["fieldRef"]["fieldPath"] for e in env.values() if "valueFrom" in e}
    assert {"metadata.name", "metadata.uid", "metadata.namespace", "status.podIP"} <= fields
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(
        values["networkPolicy"]["sideChannelPort"]) == str(kvt["spec"]["sideChannelPort"])
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert (env["KVBRIDGE_TRANSFER"]["value"], env["KVBRIDGE_ROLE"]["value"]) == (
        kvt["metadata"]["name"], role)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # Draining: every container waits for vLLM to be idle (on its own port) before SIGTERM,
    # and the grace period outlasts the wait.
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    for c in pod["spec"]["containers"]:
        drain = c["lifecycle"]["preStop"]["exec"]["command"]
        assert drain[:3] == ["kvbridge", "drain", f"--url=http://127.0.0.1:{port}"], c["name"]
        from kvbridge_agent.cli import build_parser

        timeout = build_parser().parse_args(drain[1:]).timeout
        assert pod["spec"]["terminationGracePeriodSeconds"] >= timeout + 10
    # The pod's labels reach the connector, which copies them onto its KVEndpoint.
    (podinfo,) = [v for v in pod["spec"]["volumes"] if v["name"] == "podinfo"]
    assert podinfo["downwardAPI"]["items"] == [
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
    assert {"name": "podinfo", "mountPath": "/etc/podinfo", "readOnly": True} in container[
        "volumeMounts"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_package(tmp_path: Path) -> None:
    """The packaged chart carries its CRDs, schema, README, NOTES and dashboard, and nothing
    stray."""
    import tarfile

    helm("package", str(CHART), "-d", str(tmp_path))
    (tgz,) = tmp_path.glob("kvbridge-*.tgz")
    with tarfile.open(tgz) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames()}
    assert {
        "Chart.yaml",
        "values.yaml",
        "values.schema.json",
        "README.md",
        "templates/NOTES.txt",
        "crds/kvbridge.io_kvtransfers.yaml",
        "dashboards/kvbridge.json",
    } <= names
    assert all(n.startswith(("crds/", "templates/", "dashboards/")) or "/" not in n
               for n in names), names


def test_router(rendered: dict) -> None:
    """router.enabled: a Deployment running kvbridge-router for one KVTransfer, Ready on
    /health, behind a Service, whose ServiceAccount may only read KVTransfers and KVEndpoints
    in its namespace."""
    objs = rendered["router"]
    dep = one(objs, "Deployment", "kvbridge-router")
    assert dep["metadata"]["namespace"] == "serving"
    spec = dep["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"][0] == "kvbridge-router"
    assert "--transfer=llama-70b" in container["command"]
    assert "--namespace=serving" in container["command"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert spec["serviceAccountName"] == "kvbridge-router"
    _check_drains(objs, dep, "router", "policy/v1beta1")      # rendered for Kubernetes 1.20
    role = one(objs, "Role", "kvbridge-router")
    assert role["metadata"]["namespace"] == "serving"
    assert expand_rules(role["rules"]) == READ_ONLY | POD_READS
    binding = one(objs, "RoleBinding", "kvbridge-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvbridge-router",
                                    "namespace": "serving"}]
    service = one(objs, "Service", "kvbridge-router")
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    monitor = one(objs, "PodMonitor", "kvbridge-router")
    assert monitor["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert not [o for o in rendered["defaults"] if "router" in o["metadata"]["name"]]


def _check_drains(objs: list[dict[str, Any]], dep: dict[str, Any], component: str,
                  budget_version: str) -> None:  # fmt: skip
    """Replicas that drain, with the defaults: two pods, a new one up before an old one goes,
    a SIGTERM drain of 5 + 25 s within the pod's grace period, preferably one pod per node, and
    a budget of one pod down at a time."""
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    labels = spec["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == component
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    args = _cli(pod["containers"][0]["command"])
    assert (args["drain"].delay_s, args["drain"].grace_s) == (5, 25)
    assert pod["terminationGracePeriodSeconds"] == 40
    spread = {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": labels}}}
    assert pod["affinity"] == {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}}
    budget = one(objs, "PodDisruptionBudget", dep["metadata"]["name"])
    assert budget["apiVersion"] == budget_version
    assert budget["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}


def test_router_needs_its_transfer() -> None:
    with pytest.raises(HelmError, match="/router/transfer"):
        helm("template", "x", str(CHART), "--set", "router.enabled=true")


# --- inference gateway ----------------------------------------------------------------------

GATEWAY_SETS = ["gateway.enabled=true", "gateway.transfer=llama-70b",
                "gateway.inferencePool.matchLabels.role=decode"]
WITH_POOL_API = (INFERENCE_API,)
READ_ONLY = expand_rules([{"apiGroups": ["kvbridge.io"],
                           "resources": ["kvtransfers", "kvendpoints"],
                           "verbs": ["get", "list", "watch"]}])
#: the router and the picker follow pods: a pair of a terminating or unready pod takes nothing
POD_READS = expand_rules([{"apiGroups": [""], "resources": ["pods"],
                           "verbs": ["get", "list", "watch"]}])
GATEWAY_COMPONENTS = {"endpoint-picker", "sidecar"}


def _picker(objs: list[dict[str, Any]], name: str = "kvbridge-epp") -> dict[str, Any]:
    (container,) = one(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    return container


def _cli(command: list[str]) -> dict[str, Any]:
    """A kvbridge-router command line as the real parser reads it."""
    from kvbridge_router.__main__ import parse_args

    assert command[0] == "kvbridge-router"
    return vars(parse_args(command[1:]))


def _structural(schema: dict[str, Any], where: str = "") -> None:
    """Every node of a CRD schema states its type (Kubernetes refuses non-structural ones)."""
    assert schema.get("type") or schema.get("x-kubernetes-preserve-unknown-fields"), where
    for key, sub in schema.get("properties", {}).items():
        _structural(sub, f"{where}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _structural(schema[key], f"{where}[{key}]")


def test_gateway_is_off_by_default() -> None:
    """Nothing of the gateway renders without gateway.enabled, even where the cluster serves
    the InferencePool API."""
    objs = render(api_versions=WITH_POOL_API)
    assert not [o for o in objs
                if o["metadata"]["labels"].get("app.kubernetes.io/component") in GATEWAY_COMPONENTS]
    assert not by_kind(objs, "InferencePool") and not by_kind(objs, "CustomResourceDefinition")


def test_gateway(rendered: dict) -> None:
    """gateway.enabled: `kvbridge-router epp` for one KVTransfer with gRPC probes, behind a
    Service whose gRPC port is h2c, reading only KVTransfers and KVEndpoints; an InferencePool
    of the decode pods at their sidecar's port naming that Service and failing closed; the
    same reads for the agent ServiceAccount the decode pods' sidecar runs as."""
    objs = rendered["gateway"]
    dep = one(objs, "Deployment", "kvbridge-epp")
    assert dep["metadata"]["namespace"] == "serving"
    spec = dep["spec"]["template"]["spec"]
    container = _picker(objs)
    assert container["command"] == [
        "kvbridge-router", "epp", "--transfer=llama-70b", "--namespace=serving", "--port=9002",
        "--metrics-port=9090", "--target-port=8000", "--engine-port=8000",
        "--drain-delay-seconds=5", "--drain-grace-seconds=25", *DEFAULT_PAIR_CHOICE_ARGS]
    _check_drains(objs, dep, "endpoint-picker", "policy/v1")
    args = _cli(container["command"])
    assert (args["mode"], args["transfer"], args["namespace"], args["port"],
            args["metrics_port"], args["target_port"], args["engine_port"]) == (
        "epp", "llama-70b", "serving", 9002, 9090, 8000, 8000)  # fmt: skip
    assert args["prefill_headers"] == ("x-prefiller-host-port", "x-prefill-host-port")
    assert container["image"] == _command_image(objs)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002, "metrics": 9090}
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert spec["serviceAccountName"] == "kvbridge-epp"

    role = one(objs, "Role", "kvbridge-epp")
    assert role["metadata"]["namespace"] == "serving"
    assert expand_rules(role["rules"]) == READ_ONLY | POD_READS
    binding = one(objs, "RoleBinding", "kvbridge-epp")
    assert binding["roleRef"]["name"] == "kvbridge-epp"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvbridge-epp",
                                    "namespace": "serving"}]  # fmt: skip

    service = one(objs, "Service", "kvbridge-epp")
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "grpc", "port": 9002, "targetPort": "grpc", "protocol": "TCP",
         "appProtocol": "kubernetes.io/h2c"},
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]

    pool = one(objs, "InferencePool", "llama-70b")
    assert pool["metadata"]["namespace"] == "serving"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "llama-70b",
                                     "kvbridge.io/role": "decode"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "kvbridge-epp",
                              "port": {"number": 9002}, "failureMode": "FailClose"}}

    monitor = one(objs, "PodMonitor", "kvbridge-epp")
    assert monitor["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"

    agent_sa = one(objs, "ServiceAccount", "kvbridge-agent")
    assert agent_sa["metadata"]["namespace"] == "serving"
    sidecar = one(objs, "Role", "kvbridge-sidecar")
    assert sidecar["metadata"]["namespace"] == "serving"
    assert expand_rules(sidecar["rules"]) == READ_ONLY
    binding = one(objs, "RoleBinding", "kvbridge-sidecar")
    assert binding["roleRef"]["name"] == "kvbridge-sidecar"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvbridge-agent",
                                    "namespace": "serving"}]  # fmt: skip


def _command_image(objs: list[dict[str, Any]]) -> str:
    """The operator's image, which the picker runs too."""
    return one(objs, "Deployment", "kvbridge")["spec"]["template"]["spec"]["containers"][0][
        "image"]


def test_gateway_values_reach_the_picker_and_the_pool() -> None:
    """Every gateway value lands where it is used, and the pool, the picker and its Service
    agree on the ports."""
    objs = render(sets=[*GATEWAY_SETS, "gateway.port=9100", "gateway.metricsPort=9191",
                        "gateway.enginePort=8001", "gateway.inferencePool.targetPort=8080",
                        "gateway.inferencePool.name=pool-a", "gateway.replicas=2",
                        "gateway.inferencePool.failureMode=FailOpen",
                        "gateway.prefillHeaders={x-prefill-host-port}",
                        "agent.existingServiceAccounts={vllm}"],
                  api_versions=WITH_POOL_API)  # fmt: skip
    container = _picker(objs)
    args = _cli(container["command"])
    assert (args["namespace"], args["port"], args["metrics_port"], args["engine_port"],
            args["target_port"], args["prefill_headers"]) == (
        NAMESPACE, 9100, 9191, 8001, 8080, ("x-prefill-host-port",))  # fmt: skip
    assert container["readinessProbe"]["grpc"]["port"] == 9100
    assert one(objs, "Deployment", "kvbridge-epp")["spec"]["replicas"] == 2
    pool = one(objs, "InferencePool", "pool-a")
    assert pool["spec"]["targetPorts"] == [{"number": args["target_port"]}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen"
    service = one(objs, "Service", ref["name"])
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["targetPort"] == "grpc"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == args["port"]
    subjects = one(objs, "RoleBinding", "kvbridge-sidecar")["subjects"]
    assert [s["name"] for s in subjects] == ["kvbridge-agent", "vllm"]
    # Without the sidecar Role the decode pods' ServiceAccount keeps the agent's rules only.
    objs = render(sets=[*GATEWAY_SETS, "gateway.sidecarRbac.create=false"])
    assert not [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "kvbridge-sidecar"]


def test_inference_pool_waits_for_its_api() -> None:
    """Where the cluster does not serve inference.networking.k8s.io/v1 (yet), the picker
    renders and the pool does not, so that the install (which may be creating the CRD) applies."""
    objs = render(sets=GATEWAY_SETS)
    assert _picker(objs) and not by_kind(objs, "InferencePool")
    objs = render(sets=[*GATEWAY_SETS, "gateway.installInferencePoolCRD=true"])
    assert by_kind(objs, "CustomResourceDefinition") and not by_kind(objs, "InferencePool")


def test_inference_pool_crd() -> None:
    """gateway.installInferencePoolCRD alone installs the CRD, kept on uninstall; it is a valid,
    structural v1 CRD whose schema takes the chart's and the example's pools and refuses what
    the API refuses."""
    assert not by_kind(render(sets=GATEWAY_SETS, api_versions=WITH_POOL_API),
                       "CustomResourceDefinition")  # fmt: skip
    crd = one(render(sets=["gateway.installInferencePoolCRD=true"]), "CustomResourceDefinition")
    _validate_k8s(crd)
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "api-approved.kubernetes.io" in crd["metadata"]["annotations"]  # a *.k8s.io group
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        "inference.networking.k8s.io", "Namespaced", "InferencePool", "inferencepools")
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
    assert version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    _structural(schema)
    assert schema["properties"]["spec"]["required"] == ["selector", "targetPorts"]

    pool = one(render(sets=GATEWAY_SETS, api_versions=WITH_POOL_API), "InferencePool")
    jsonschema.validate(pool, schema)
    (example,) = yaml.safe_load_all((REPO / "examples" / "serving" / "inferencepool.yaml")
                                    .read_text())  # fmt: skip
    jsonschema.validate(one(example["items"], "InferencePool"), schema)

    def broken(**spec: Any) -> dict[str, Any]:
        return {**pool, "spec": {**pool["spec"], **spec}}

    ref = pool["spec"]["endpointPickerRef"]
    for bad in (broken(targetPorts=[]), broken(targetPorts=[{"number": 0}]),
                broken(targetPorts=[{"number": 8000 + i} for i in range(9)]),
                broken(selector={"matchLabels": {}}), broken(selector={}),
                broken(endpointPickerRef={**ref, "failureMode": "Open"}),
                broken(endpointPickerRef={"port": {"number": 9002}}),
                broken(appProtocol="grpc"),
                {**pool, "spec": {"targetPorts": [{"number": 8000}]}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(("sets", "kube_version", "fragment"), [
    (["gateway.enabled=true", "gateway.inferencePool.matchLabels.role=decode"], None,
     "/gateway/transfer"),
    (["gateway.enabled=true", "gateway.transfer=t"], None, "/gateway/inferencePool/matchLabels"),
    ([*GATEWAY_SETS, "gateway.inferencePool.failureMode=Open"], None,
     "/gateway/inferencePool/failureMode"),
    ([*GATEWAY_SETS, "gateway.prefillHeaders={X-Prefill}"], None, "/gateway/prefillHeaders/0"),
    ([*GATEWAY_SETS, "gateway.namespace=serving"], None,
     "gateway.namespace: the decode pods run in serving, which must be one of agent.namespaces"),
], ids=["transfer", "matchLabels", "failureMode", "prefillHeaders", "namespace"])
def test_gateway_refuses_incomplete_values(sets: list[str], kube_version: str | None,
                                           fragment: str) -> None:  # fmt: skip
    with pytest.raises(HelmError) as err:
        render(sets=sets, kube_version=kube_version)
    assert fragment in str(err.value), str(err.value)


def test_gateway_probes_before_kubernetes_1_24() -> None:
    """No gRPC probes before 1.24 (the local test node's 1.20): /ready on the metrics port
    (false while draining) for readiness, the gRPC port accepting connections for liveness."""
    objs = render(sets=GATEWAY_SETS, kube_version="1.20.2")
    container = _picker(objs)
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": 9002}
    assert "grpc" not in container["readinessProbe"]
    assert one(objs, "PodDisruptionBudget", "kvbridge-epp")["apiVersion"] == "policy/v1beta1"


@pytest.mark.parametrize(("component", "sets", "name"), [
    ("router", ["router.enabled=true", "router.transfer=t"], "kvbridge-router"),
    ("gateway", GATEWAY_SETS, "kvbridge-epp")])
def test_drain_values_reach_the_pods(component: str, sets: list[str], name: str,
                                     tmp_path: Path) -> None:  # fmt: skip
    """Every drain value lands where it is used: the flags, a grace period that outlasts the
    drain (rounded up, plus 10 s), the budget (a percentage kept a string; none when
    disabled), an affinity of one's own instead of the spread."""
    values = tmp_path / "drain.yaml"
    values.write_text(yaml.safe_dump({component: {
        "replicas": 3, "drain": {"delaySeconds": 2.5, "graceSeconds": 120.2},
        "podDisruptionBudget": {"maxUnavailable": "50%"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}}}))
    objs = render(sets=sets, files=[values], kube_version="1.29.0")
    dep = one(objs, "Deployment", name)
    pod = dep["spec"]["template"]["spec"]
    args = _cli(pod["containers"][0]["command"])
    assert (dep["spec"]["replicas"], args["drain"].delay_s, args["drain"].grace_s) == (
        3, 2.5, 120.2)
    assert pod["terminationGracePeriodSeconds"] == 133
    assert list(pod["affinity"]) == ["nodeAffinity"]
    budget = one(objs, "PodDisruptionBudget", name)
    assert budget["apiVersion"] == "policy/v1" and budget["spec"]["maxUnavailable"] == "50%"
    _validate_k8s(budget)
    objs = render(sets=[*sets, f"{component}.podDisruptionBudget.enabled=false"])
    assert name not in {o["metadata"]["name"] for o in by_kind(objs, "PodDisruptionBudget")}


def test_gateway_example_fits_the_serving_pods() -> None:
    """examples/serving/: inferencepool.yaml holds what the chart's gateway.enabled renders for
    the example's KVTransfer; decode.yaml's sidecar listens on the pool's target port and calls
    its own pod's vLLM, whose port the KVEndpoint publishes for the router; the prefills serve
    where the picker and the sidecar expect them; httproute.yaml names the pool."""
    serving = REPO / "examples" / "serving"
    (kvt,) = yaml.safe_load_all((serving / "kvtransfer.yaml").read_text())
    (listed,) = yaml.safe_load_all((serving / "inferencepool.yaml").read_text())
    # One document: kvbridge_testkit.vllm_pods.manifests loads every example file as one.
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    items = listed["items"]
    for obj in items:
        if obj["kind"] == "InferencePool":
            jsonschema.validate(obj, _crd_schemas()[(INFERENCE_API, "InferencePool")])
        else:
            _validate_k8s(obj)
    pool = one(items, "InferencePool")
    decode_labels = kvt["spec"]["decode"]["selector"]["matchLabels"]

    # The chart, told the example's KVTransfer, renders the same pool and picker.
    escaped = [f"gateway.inferencePool.matchLabels.{k.replace('.', chr(92) + '.')}={v}"
               for k, v in decode_labels.items()]  # fmt: skip
    chart = render(sets=["agent.namespaces={serving}", "gateway.enabled=true",
                         f"gateway.transfer={kvt['metadata']['name']}",
                         "gateway.namespace=serving", *escaped],
                   api_versions=WITH_POOL_API)  # fmt: skip
    chart_pool = one(chart, "InferencePool")
    assert pool["metadata"]["name"] == chart_pool["metadata"]["name"]
    ref, chart_ref = pool["spec"]["endpointPickerRef"], chart_pool["spec"]["endpointPickerRef"]
    assert {**pool["spec"], "endpointPickerRef": {**ref, "name": "-"}} == {
        **chart_pool["spec"], "endpointPickerRef": {**chart_ref, "name": "-"}}
    assert pool["spec"]["selector"]["matchLabels"] == decode_labels
    service = one(items, "Service", ref["name"])
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    dep = one(items, "Deployment", ref["name"])
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    (picker,) = dep["spec"]["template"]["spec"]["containers"]
    chart_picker = _picker(chart)
    args = _cli(picker["command"])
    # The example takes its namespace from POD_NAMESPACE; the chart names it.
    assert {**args, "namespace": "serving"} == _cli(chart_picker["command"])
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in picker["env"]} == {
        "POD_NAMESPACE": "metadata.namespace"}
    assert picker["image"] == _command_image(render())
    assert picker["readinessProbe"] == chart_picker["readinessProbe"]
    assert picker["livenessProbe"] == chart_picker["livenessProbe"]
    # Replicas that drain, as the chart's (selectors differ: the example's own labels).
    chart_dep = one(chart, "Deployment", "kvbridge-epp")
    for key in ("replicas", "strategy"):
        assert dep["spec"][key] == chart_dep["spec"][key], key
    pod, chart_pod = dep["spec"]["template"]["spec"], chart_dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == chart_pod["terminationGracePeriodSeconds"]
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == \
        dep["spec"]["selector"]["matchLabels"]
    budget = one(items, "PodDisruptionBudget")
    chart_budget = one(chart, "PodDisruptionBudget", "kvbridge-epp")
    assert budget["spec"]["selector"] == dep["spec"]["selector"]
    assert budget["spec"]["maxUnavailable"] == chart_budget["spec"]["maxUnavailable"]
    assert [(p["name"], p["containerPort"]) for p in picker["ports"]] == [
        (p["name"], p["containerPort"]) for p in chart_picker["ports"]]
    assert picker["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    for role in by_kind(items, "Role"):
        assert expand_rules(role["rules"]) == READ_ONLY
    bound = {b["roleRef"]["name"]: [(s["kind"], s["name"], s["namespace"]) for s in b["subjects"]]
             for b in by_kind(items, "RoleBinding")}  # fmt: skip
    assert set(bound) == {r["metadata"]["name"] for r in by_kind(items, "Role")}
    agent_sa = one(render(), "ServiceAccount", "kvbridge-agent")["metadata"]["name"]
    assert sorted(bound.values()) == sorted([[("ServiceAccount", sa, "serving")],
                                             [("ServiceAccount", agent_sa, "serving")]])

    # decode.yaml: the sidecar on the pool's target port in front of the pod's own vLLM.
    (decode,) = yaml.safe_load_all((serving / "decode.yaml").read_text())
    (prefill,) = yaml.safe_load_all((serving / "prefill.yaml").read_text())
    template = decode["spec"]["template"]
    assert decode_labels.items() <= template["metadata"]["labels"].items()
    assert not decode_labels.items() <= prefill["spec"]["template"]["metadata"]["labels"].items()
    assert template["spec"]["serviceAccountName"] == agent_sa
    vllm, sidecar = template["spec"]["containers"]
    cli = _cli(sidecar["command"])
    assert (cli["mode"], cli["transfer"], cli["pod_name"], cli["without_prefill_header"]) == (
        "sidecar", kvt["metadata"]["name"], "$(POD_NAME)", "refuse")
    assert cli["port"] == pool["spec"]["targetPorts"][0]["number"] == args["target_port"]
    assert [p["containerPort"] for p in sidecar["ports"]] == [cli["port"]]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert sidecar["image"] == picker["image"]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The same QoS as vLLM's container (none set in this CPU example): a request on the sidecar
    # alone made the decode pods Burstable, and their CPU weight starved the prefill's engine.
    assert sidecar.get("resources") == vllm.get("resources") is None

    def vllm_port(container: dict[str, Any]) -> int:
        (arg,) = [a for a in container["command"] if a.startswith("--port=")]
        return int(arg.split("=", 1)[1])

    def serving_port(container: dict[str, Any]) -> int:
        (value,) = [e["value"] for e in container["env"] if e["name"] == "KVBRIDGE_SERVING_PORT"]
        return int(value)

    # The sidecar reaches its vLLM on loopback; the router reaches it at the KVEndpoint's
    # servingPort; both are vLLM's port, and not the sidecar's.
    assert cli["decode_url"] == f"http://127.0.0.1:{vllm_port(vllm)}"
    assert serving_port(vllm) == vllm_port(vllm) != cli["port"]
    assert {p["containerPort"] for p in vllm["ports"] if p["name"] == "http"} == {vllm_port(vllm)}
    # Prefills are named by their servingPort, which is their vLLM's port.
    (prefill_vllm,) = prefill["spec"]["template"]["spec"]["containers"]
    assert serving_port(prefill_vllm) == vllm_port(prefill_vllm) == args["engine_port"]

    (route,) = yaml.safe_load_all((serving / "httproute.yaml").read_text())
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert [r["backendRefs"] for r in route["spec"]["rules"]] == [[{
        "group": "inference.networking.k8s.io", "kind": "InferencePool",
        "name": pool["metadata"]["name"]}]]


# --- pair choice ----------------------------------------------------------------------------

DEFAULT_PAIR_CHOICE_ARGS = [
    "--policy=least-load", "--prefill-ms-per-block=1", "--queue-ms=10",
    "--pull-ms-per-block=0.1", "--decode-queue-ms=2", "--eviction-weight=1",
    "--balance-factor=1.5", "--balance-slack=3", "--kv-events-port=0",
    "--load-interval-seconds=1", "--chars-per-token=4"]
CUSTOM_PAIR_CHOICE_ARGS = [
    "--policy=cache-aware", "--prefill-ms-per-block=0.25", "--queue-ms=0",
    "--pull-ms-per-block=0.5", "--decode-queue-ms=3", "--eviction-weight=2.5",
    "--balance-factor=2",
    "--balance-slack=1", "--transport-gbps=cma=9,rc_mlx5=25,tcp=1.2", "--kv-events-port=5557",
    "--load-interval-seconds=0.5", "--chars-per-token=3.5"]


def _router(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(objs, "Deployment", "kvbridge-router")["spec"]["template"]["spec"][
        "containers"]
    return container


@functools.cache
def _pair_choice_flags(*mode: str) -> tuple[str, ...]:
    """The flags of the CLI's "pair choice" group, read from its --help."""
    from kvbridge_router.__main__ import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args([*mode, "--help"])
    section = out.getvalue().split("\npair choice", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]   # up to the next group's title
    return tuple(re.findall(r"^  (--[a-z-]+)", section, re.M))


def _pair_choice(command: list[str]) -> dict[str, Any]:
    dests = {f[2:].replace("-", "_") for f in _pair_choice_flags()}
    return {k: v for k, v in _cli(command).items() if k in dests}


def test_pair_choice_defaults_are_the_clis(rendered: dict) -> None:
    """Without pairChoice the router and the picker get every pair-choice flag of the CLI
    (transportGbps aside: empty, the built-in table), each at the CLI's own default
    (least-load)."""
    from kvbridge_router.__main__ import parse_args

    flags = _pair_choice_flags()
    assert flags == _pair_choice_flags("epp")
    assert "--policy" in flags and "--kv-events-port" in flags
    router = _router(rendered["router"])["command"]
    picker = _picker(rendered["gateway"])["command"]
    n = len(DEFAULT_PAIR_CHOICE_ARGS)
    assert router[-n:] == picker[-n:] == DEFAULT_PAIR_CHOICE_ARGS
    assert {a.split("=", 1)[0] for a in DEFAULT_PAIR_CHOICE_ARGS} == set(flags) - {
        "--transport-gbps"}
    cli = {k: v for k, v in vars(parse_args(["--transfer=t"])).items()
           if k in _pair_choice(router)}  # fmt: skip
    assert _pair_choice(router) == _pair_choice(picker) == cli
    assert cli["policy"] == "least-load" and cli["transport_gbps"] == ""


def test_pair_choice_reaches_the_router_and_the_picker(rendered: dict) -> None:
    """A custom pairChoice lands on both command lines alike (transportGbps sorted by name),
    and their parsers read it as set."""
    objs = rendered["pair-choice"]
    router, picker = _router(objs)["command"], _picker(objs)["command"]
    n = len(CUSTOM_PAIR_CHOICE_ARGS)
    assert router[-n:] == picker[-n:] == CUSTOM_PAIR_CHOICE_ARGS
    assert {a.split("=", 1)[0] for a in CUSTOM_PAIR_CHOICE_ARGS} == set(_pair_choice_flags())
    assert _pair_choice(router) == _pair_choice(picker) == {
        "policy": "cache-aware", "prefill_ms_per_block": 0.25, "queue_ms": 0.0,
        "pull_ms_per_block": 0.5, "decode_queue_ms": 3.0, "eviction_weight": 2.5,
        "balance_factor": 2.0,
        "balance_slack": 1.0, "transport_gbps": "cma=9,rc_mlx5=25,tcp=1.2",
        "kv_events_port": 5557, "load_interval_seconds": 0.5, "chars_per_token": 3.5}
    # The other flags stay where they were.
    assert _cli(router)["engine_port"] == _cli(picker)["engine_port"] == 8000


def test_pair_choice_networkpolicy(rendered: dict) -> None:
    """networkPolicy.enabled: besides the side-channel policy, the router's and the picker's
    pods may reach the serving pods on the engine port (requests, /tokenize, /metrics),
    pairChoice.extraEnginePorts and the KV-event port (precise tracking)."""
    objs = rendered["pair-choice"]
    policies = {p["metadata"]["name"]: p for p in by_kind(objs, "NetworkPolicy")}
    assert set(policies) == {"kvbridge-side-channel", "kvbridge-router", "kvbridge-epp"}
    serving = policies["kvbridge-side-channel"]["spec"]["podSelector"]
    for name in ("kvbridge-router", "kvbridge-epp"):
        pol = policies[name]
        pods = one(objs, "Deployment", name)["spec"]["selector"]["matchLabels"]
        assert pol["metadata"]["namespace"] == "serving"
        assert pol["spec"]["podSelector"] == serving
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        assert pol["spec"]["ingress"] == [{
            "from": [{"podSelector": {"matchLabels": pods}}],
            "ports": [{"port": 8000, "protocol": "TCP"}, {"port": "http", "protocol": "TCP"},
                      {"port": 5557, "protocol": "TCP"}]}]  # fmt: skip
    # Approximate tracking: the engine port only (once, though listed again); the picker's
    # own gateway.enginePort.
    objs = render(sets=[*GATEWAY_SETS, "router.enabled=true", "router.transfer=t",
                        "networkPolicy.enabled=true", "gateway.enginePort=8001",
                        "pairChoice.extraEnginePorts={8000}"])  # fmt: skip
    assert one(objs, "NetworkPolicy", "kvbridge-router")["spec"]["ingress"][0]["ports"] == [
        {"port": 8000, "protocol": "TCP"}]
    assert one(objs, "NetworkPolicy", "kvbridge-epp")["spec"]["ingress"][0]["ports"] == [
        {"port": 8001, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]
    # No chart policy where the router runs, or none at all: nothing to open.
    objs = render(sets=["router.enabled=true", "router.transfer=t", "router.namespace=other",
                        "networkPolicy.enabled=true", "pairChoice.kvEventsPort=5557"])
    assert [p["metadata"]["name"] for p in by_kind(objs, "NetworkPolicy")] == [
        "kvbridge-side-channel"]
    assert not by_kind(rendered["router"], "NetworkPolicy")
    assert not by_kind(rendered["gateway"], "NetworkPolicy")


BAD_PAIR_CHOICE = [
    (["pairChoice.policy=round-robin"],
     "'/pairChoice/policy': value must be one of 'least-load', 'cache-aware'"),
    (["pairChoice.balanceFactor=0"], "'/pairChoice/balanceFactor': minimum"),
    (["pairChoice.prefillMsPerBlock=-1"], "'/pairChoice/prefillMsPerBlock': minimum"),
    (["pairChoice.queueMs=-1"], "'/pairChoice/queueMs': minimum"),
    (["pairChoice.pullMsPerBlock=-1"], "'/pairChoice/pullMsPerBlock': minimum"),
    (["pairChoice.decodeQueueMs=-1"], "'/pairChoice/decodeQueueMs': minimum"),
    (["pairChoice.kvEventsPort=70000"], "'/pairChoice/kvEventsPort': maximum"),
    (["pairChoice.kvEventsPort=-1"], "'/pairChoice/kvEventsPort': minimum"),
    (["pairChoice.loadIntervalSeconds=0"], "'/pairChoice/loadIntervalSeconds': exclusiveMinimum"),
    (["pairChoice.charsPerToken=0"], "'/pairChoice/charsPerToken': exclusiveMinimum"),
    (["pairChoice.transportGbps.tcp=0"], "'/pairChoice/transportGbps/tcp': exclusiveMinimum"),
    (["pairChoice.transportGbps.TCP=1"],
     "'/pairChoice/transportGbps': additional properties 'TCP' not allowed"),
    (["pairChoice.extraEnginePorts={0}"], "'/pairChoice/extraEnginePorts/0'"),
    (["pairChoice.polcy=cache-aware"], "'/pairChoice': additional properties 'polcy'"),
]  # fmt: skip


@pytest.mark.parametrize(("sets", "fragment"), BAD_PAIR_CHOICE,
                         ids=[s[0][0] for s in BAD_PAIR_CHOICE])  # fmt: skip
def test_schema_rejects_bad_pair_choice(sets: list[str], fragment: str) -> None:
    with pytest.raises(HelmError) as err:
        render(sets=sets)
    assert "don't meet the specifications of the schema" in str(err.value)
    assert fragment in str(err.value), str(err.value)


def test_schema_rejects_a_fractional_balance_factor_below_1() -> None:
    """A number, not only an integer, below 1 (--set passes fractions as strings)."""
    with pytest.raises(HelmError) as err:
        helm("template", "x", str(CHART), "--set-json", "pairChoice.balanceFactor=0.5")
    assert "'/pairChoice/balanceFactor': minimum: got 0.5" in str(err.value), str(err.value)
    helm("template", "x", str(CHART), "--set-json", "pairChoice.balanceFactor=1")
