"""Helpers for the e2e tests: the operator installed as in production, API shortcuts, a fake
agent.

The operator runs the way it runs in a cluster (kvbridge_testkit.operator_process: ``kopf run
--all-namespaces -m kvbridge_operator.main`` in its own process), authenticated with a
ServiceAccount token bound to ``hack/operator-rbac.yaml`` only, serving the admission webhook
over loopback TLS.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS, GROUP, TRANSFERS, VERSION
from kvbridge_testkit import REPO
from kvbridge_testkit.operator_process import OperatorProcess, loopback_settings

T = TypeVar("T")


def wait_for(fn: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.2,
             what: str = "condition") -> T:  # fmt: skip
    """Poll ``fn`` until it returns something truthy; fail with the last value on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (ApiException, KeyError, IndexError, StopIteration) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


OPERATOR_NS, OPERATOR_SA = "kvbridge-system", "kvbridge-operator"
#: The operator's Lease (``KVBRIDGE_LEASE_NAME``'s default, in the operator's namespace).
OPERATOR_LEASE = "kvbridge-operator"


def lease_holder(api_client: Any, namespace: str = OPERATOR_NS, name: str = OPERATOR_LEASE
                 ) -> str | None:  # fmt: skip
    """The Lease's ``holderIdentity`` ("" once released), None while there is no Lease."""
    try:
        found = client.CoordinationV1Api(api_client).read_namespaced_lease(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return found.spec.holder_identity or ""


@contextlib.contextmanager
def crd_cluster(nodes: Mapping[str, Mapping[str, str]], workdir: Path | None = None
                ) -> Iterator[Any]:  # fmt: skip
    """A LocalCluster with kvbridge's CRDs established and fake ``nodes``, stopped after use.
    Missing binaries FAIL (CI must run these tests): ``bash hack/test-stack.sh ensure``."""
    import pytest

    from kvbridge_testkit import cluster as kc

    try:
        binaries = kc.Binaries.find()
    except kc.StackMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    kw = {"workdir": workdir} if workdir is not None else {}
    with kc.LocalCluster(binaries=binaries, **kw) as c:
        c.kubectl("apply", "-f", str(REPO / "crds"))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        with kc.FakeKubelet(c.api_client(), nodes):
            yield c


def deploy_operator(cluster: Any, workdir: Path, env: dict[str, str] | None = None, *,
                    extra_args: Iterable[str] = ()) -> OperatorProcess:  # fmt: skip
    """Install the operator as in production on ``cluster`` (a LocalCluster): its
    ServiceAccount bound to hack/operator-rbac.yaml only, leader election on the Lease
    ``kvbridge-system/kvbridge-operator``, the admission webhook over loopback TLS; start it
    (``env`` adds KVBRIDGE_* settings, ``extra_args`` kopf run options) and register the
    webhook. Shared by the e2e and fault fixtures and the benchmarks; the caller stops it."""
    from kvbridge_operator.webhook import self_signed_certificate, webhook_configuration
    from kvbridge_testkit import cluster as kc

    k = cluster.kubectl
    k("create", "namespace", OPERATOR_NS)
    k("create", "serviceaccount", OPERATOR_SA, "-n", OPERATOR_NS)
    k("apply", "-f", str(REPO / "hack" / "operator-rbac.yaml"))
    k("create", "clusterrolebinding", "kvbridge-operator", "--clusterrole=kvbridge-operator",
      f"--serviceaccount={OPERATOR_NS}:{OPERATOR_SA}")  # fmt: skip
    token = cluster.service_account_token(OPERATOR_NS, OPERATOR_SA)
    kubeconfig = cluster.kubeconfig_for_token(token, "operator")
    ports = {"metrics": kc.free_port(), "liveness": kc.free_port(), "webhook": kc.free_port()}
    cert, key = self_signed_certificate(workdir, ["127.0.0.1", "localhost"])
    settings = {**loopback_settings(ports, cert, key), "POD_NAMESPACE": OPERATOR_NS,
                **(env or {})}  # fmt: skip
    op = OperatorProcess(kubeconfig, workdir, settings, ports, extra_args=extra_args)
    op.start()
    vwc = webhook_configuration(
        "kvbridge-validation", Path(cert).read_bytes(), url=f"https://127.0.0.1:{ports['webhook']}"
    )
    try:
        client.AdmissionregistrationV1Api(
            cluster.api_client()
        ).create_validating_webhook_configuration(vwc)
    except BaseException:
        op.stop()
        raise
    return op


class Api:
    """Thin shortcuts over the official client for KVTransfers, KVEndpoints and Pods."""

    def __init__(self, api_client: Any) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    # -- custom resources -------------------------------------------------------------------
    def create(self, plural: str, ns: str, body: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)

    def get(self, plural: str, ns: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name)

    def list(self, plural: str, ns: str) -> list[dict]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, plural)["items"]

    def patch(self, plural: str, ns: str, name: str, body: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, plural, name, body)

    def patch_status(self, plural: str, ns: str, name: str, status: dict) -> dict:
        return self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, plural, name, {"status": status}
        )

    def delete(self, plural: str, ns: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def transfer(self, ns: str, name: str = "kvt") -> dict:
        return self.get(TRANSFERS, ns, name)

    def endpoint(self, ns: str, name: str) -> dict:
        return self.get(ENDPOINTS, ns, name)

    def endpoints(self, ns: str) -> dict[str, dict]:
        return {e["metadata"]["name"]: e for e in self.list(ENDPOINTS, ns)}

    def create_transfer(self, ns: str, name: str = "kvt", **kw: Any) -> dict:
        return self.create(TRANSFERS, ns, manifests.transfer_manifest(name, **kw))

    # -- conditions -------------------------------------------------------------------------
    def condition(self, ns: str, ctype: str, name: str = "kvt") -> dict:
        conds = (self.transfer(ns, name).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == ctype), {})

    def wait_condition(self, ns: str, ctype: str, status: str, *, reason: str | None = None,
                       name: str = "kvt", timeout: float = 30.0) -> dict:  # fmt: skip
        def check() -> dict:
            c = self.condition(ns, ctype, name)
            ok = c.get("status") == status and (reason is None or c.get("reason") == reason)
            return c if ok else {}

        return wait_for(check, timeout=timeout, what=f"{ctype}={status} ({reason or 'any'})")

    # -- the fake agent ---------------------------------------------------------------------
    def start_engine(self, ns: str, engine_id: str, role: str, tp_size: int = 1, *,
                     node: str | None = None, epoch: int = 1, **kw: Any) -> list[str]:  # fmt: skip
        """Pods (one per TP rank) and their KVEndpoints, owned by the pods, as agents would."""
        names = [f"{engine_id}-{r}" for r in range(tp_size)]
        for n in names:
            pod: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": n, "labels": {"kvbridge.io/role": role}},
                "spec": {"containers": [{"name": "engine", "image": "vllm:fake"}]},
            }
            if node:
                pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
            self.core.create_namespaced_pod(ns, pod)
        for r, n in enumerate(names):
            pod = wait_for(lambda n=n: self._running(ns, n), what=f"pod {n} running")
            body = manifests.endpoint_manifest(
                n, role=role, engine_id=engine_id, tp_rank=r, tp_size=tp_size, epoch=epoch,
                host=pod.status.pod_ip, node_name=pod.spec.node_name,
                pod={"name": n, "uid": pod.metadata.uid}, **kw,
            )  # fmt: skip
            self.create(ENDPOINTS, ns, body)
        return names

    def _running(self, ns: str, name: str) -> Any:
        pod = self.core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    def delete_pods(self, ns: str, names: Iterable[str]) -> None:
        for n in names:
            self.core.delete_namespaced_pod(n, ns)

    def report_handshakes(self, ns: str, names: Iterable[str] | None = None, ok: bool = True,
                          message: str = "") -> int:  # fmt: skip
        """Act as the decode agents: record a handshake with every assigned peer."""
        written = 0
        for name, e in self.endpoints(ns).items():
            if e["spec"]["role"] != "decode" or (names is not None and name not in names):
                continue
            peers = (e.get("status") or {}).get("peers") or []
            entries = [manifests.handshake(p["name"], p["epoch"], ok, message) for p in peers]
            if entries and entries != (e.get("status") or {}).get("handshakes"):
                self.patch_status(ENDPOINTS, ns, name, {"handshakes": entries})
                written += 1
        return written
