"""Helpers for the chart tests: find helm, render the chart, index rendered objects, and read
RBAC rules into comparable sets."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_testkit.e2e import wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvbridge"
VALUES_DIR = Path(__file__).resolve().parent / "values"
CACHE_BIN = Path(os.environ.get("KVB_CACHE", "/var/cache/kvbridge")) / "bin"
RELEASE = "kvbridge"
NAMESPACE = "kvbridge-system"

# Kinds (by apiVersion) that Kubernetes 1.20 serves; the chart's kubeVersion floor.
K8S_120_KINDS = {
    ("v1", "ServiceAccount"),
    ("v1", "Service"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"),
    ("policy/v1beta1", "PodDisruptionBudget"),
}
# Kinds the chart renders only for a cluster that serves them (an older version of the same
# kind above otherwise), with the first Kubernetes version that does.
NEWER_KINDS = {("policy/v1", "PodDisruptionBudget"): (1, 21)}
# Kinds from CRDs: ours (crds/), the InferencePool (templates/inferencepool-crd.yaml, or the
# gateway's own) and the optional integrations.
CRD_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


def tool(name: str) -> str | None:
    """Path of a test-stack binary (KVB_HELM/KVB_KUBECTL, the cache, then PATH)."""
    env = os.environ.get(f"KVB_{name.upper()}")
    if env and os.access(env, os.X_OK):
        return env
    cached = CACHE_BIN / name
    if os.access(cached, os.X_OK):
        return str(cached)
    return shutil.which(name)


#: Marks the tests that render the chart: they need the test stack's helm.
needs_helm = pytest.mark.skipif(
    tool("helm") is None, reason="helm missing: run hack/test-stack.sh ensure"
)


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


def helm(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    exe = tool("helm")
    if exe is None:
        raise HelmError("helm not found (run hack/test-stack.sh ensure)")
    proc = subprocess.run(
        [exe, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise HelmError(
            f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )
    return proc.stdout


def values_file(name: str) -> Path:
    return VALUES_DIR / f"{name}.yaml"


def values_files() -> list[str]:
    return sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))


def render(
    values: str | None = None,
    *,
    sets: Sequence[str] = (),
    kube_version: str | None = None,
    include_crds: bool = False,
    namespace: str = NAMESPACE,
    api_versions: Sequence[str] = (),
    files: Sequence[Path] = (),
) -> list[dict[str, Any]]:
    """`helm template` the chart and return the objects (empty documents dropped).

    ``api_versions`` are the extra APIs the pretend cluster serves. ``files``: more values
    files (for values ``--set`` cannot give, such as fractional numbers).
    """
    args = ["template", RELEASE, str(CHART), "--namespace", namespace]
    for api in api_versions:
        args += ["--api-versions", api]
    if values:
        args += ["-f", str(values_file(values))]
    for path in files:
        args += ["-f", str(path)]
    for s in sets:
        args += ["--set", s]
    if kube_version:
        args += ["--kube-version", kube_version]
    if include_crds:
        args.append("--include-crds")
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


@dataclass(frozen=True)
class Rule:
    """One (apiGroup, resource, verb) permission, the unit RBAC comparisons work in."""

    group: str
    resource: str
    verb: str


def expand_rules(rules: Iterable[dict[str, Any]], *, named: bool = False) -> set[Rule]:
    """The rules as (group, resource, verb) units; ``named`` allows rules limited to
    ``resourceNames`` (the Lease's), whose resource then reads ``leases/<name>``."""
    out: set[Rule] = set()
    for r in rules:
        if named and r.get("resourceNames"):
            out |= {Rule(g, f"{res}/{n}", v) for g in r.get("apiGroups", [])
                    for res in r.get("resources", []) for n in r["resourceNames"]
                    for v in r.get("verbs", [])}  # fmt: skip
            continue
        assert not r.get("resourceNames"), f"unexpected resourceNames in {r}"
        assert not r.get("nonResourceURLs"), f"unexpected nonResourceURLs in {r}"
        for g in r.get("apiGroups", []):
            for res in r.get("resources", []):
                for v in r.get("verbs", []):
                    out.add(Rule(g, res, v))
    return out


def by_kind(objs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def one(objs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def iter_containers(objs: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for o in by_kind(objs, "Deployment"):
        spec = o["spec"]["template"]["spec"]
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


@dataclass
class Kube:
    """helm and kubectl against the local cluster, as the admin unless told otherwise."""

    cluster: Any  # kvbridge_testkit.cluster.LocalCluster
    helm_home: Path

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.cluster.kubeconfig),
            "HELM_CACHE_HOME": str(self.helm_home / "cache"),
            "HELM_CONFIG_HOME": str(self.helm_home / "config"),
            "HELM_DATA_HOME": str(self.helm_home / "data"),
        }

    def helm(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(
            [str(self.cluster.binaries.helm), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise HelmError(
                f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
            )
        return proc.stdout + proc.stderr

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = self.cluster.kubectl(*args, check=False, input=input, kubeconfig=kubeconfig)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def get(self, *args: str, kubeconfig: Path | None = None) -> dict[str, Any]:
        return yaml.safe_load(
            self.kubectl("get", *args, "-o", "yaml", kubeconfig=kubeconfig).stdout
        )

    def exists(self, *args: str) -> bool:
        return self.kubectl("get", *args, check=False).returncode == 0

    def snapshot(self) -> set[tuple[str, str, str]]:
        """(kind, namespace, name) of every listable object except events and leases."""
        names = self.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
        kinds = [n for n in names if n.split(".")[0] not in {"events", "leases"}]
        out = self.kubectl(
            "get",
            ",".join(kinds),
            "-A",
            "--no-headers",
            "-o",
            "custom-columns=K:.kind,NS:.metadata.namespace,N:.metadata.name",
        )
        return {tuple(line.split()) for line in out.stdout.splitlines() if line.strip()}

    def create_namespace(self, name: str) -> None:
        if not self.exists("namespace", name):
            self.kubectl("create", "namespace", name)
        # The namespace's default ServiceAccount (and on 1.20 its token Secret) appear
        # asynchronously; wait so that snapshots taken later do not count them as new.
        wait_for(
            lambda: (
                self.kubectl("get", "secrets", "-n", name, "-o", "name").stdout.count(
                    "default-token-"
                )
                == 1
            ),
            what=f"default token in {name}",
            timeout=30,
        )

    def token_kubeconfig(self, namespace: str, service_account: str) -> Path:
        token = self.cluster.service_account_token(namespace, service_account)
        return self.cluster.kubeconfig_for_token(token, f"{namespace}-{service_account}")
