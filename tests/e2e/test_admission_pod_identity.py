"""Only the pod that owns a KVEndpoint may write it: the admission webhook compares the owner
Pod with the pod bound into the requester's ServiceAccount token (real apiserver, real
pod-bound tokens, the operator's webhook)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes.client.exceptions import ApiException

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS, GROUP
from kvbridge_testkit.e2e import Api, wait_for

pytestmark = pytest.mark.k8s

AGENT_SA = "kvbridge-agent"
AGENT_ROLE = f"""
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: kvbridge-agent}}
rules:
- apiGroups: [{GROUP}]
  resources: [kvendpoints]
  verbs: [create, get, update, patch]
"""


@pytest.fixture
def pods(cluster, api: Api, ns: str) -> Iterator[dict[str, dict[str, str]]]:
    """Two Running pods running as the agent ServiceAccount, which may write KVEndpoints."""
    k = cluster.kubectl
    k("create", "serviceaccount", AGENT_SA, "-n", ns)
    k("apply", "-n", ns, "-f", "-", input=AGENT_ROLE)
    k("create", "rolebinding", "kvbridge-agent", "-n", ns, "--role=kvbridge-agent",
      f"--serviceaccount={ns}:{AGENT_SA}")  # fmt: skip
    out = {}
    for name in ("pod-a", "pod-b"):
        pod = api.core.create_namespaced_pod(ns, {
            "metadata": {"name": name},
            "spec": {"serviceAccountName": AGENT_SA, "automountServiceAccountToken": False,
                     "containers": [{"name": "vllm", "image": "vllm:placeholder"}]},
        })
        out[name] = {"name": name, "uid": pod.metadata.uid}
    wait_for(lambda: all(api.core.read_namespaced_pod(n, ns).status.phase == "Running"
                         for n in out), timeout=30, what="pods Running")
    yield out


def _client_as_pod(cluster, ns: str, pod: str | None) -> Api:
    args = ["create", "token", AGENT_SA, "-n", ns, "--duration=600s"]
    if pod is not None:
        args += ["--bound-object-kind", "Pod", "--bound-object-name", pod]
    token = cluster.kubectl(*args).stdout.strip()
    return Api(cluster.api_client(cluster.kubeconfig_for_token(token, f"{ns}-{pod}")))


def _endpoint(name: str, owner: dict[str, str]) -> dict:
    return manifests.endpoint_manifest(name, role="decode", engine_id=name, pod=owner)


def _rejection(exc: pytest.ExceptionInfo[ApiException]) -> str:
    return json.loads(exc.value.body)["message"]


def test_a_pod_publishes_its_own_endpoint(cluster, ns: str, pods) -> None:
    as_a = _client_as_pod(cluster, ns, "pod-a")
    created = as_a.create(ENDPOINTS, ns, _endpoint("ep-a", pods["pod-a"]))
    assert created["metadata"]["ownerReferences"][0]["uid"] == pods["pod-a"]["uid"]
    as_a.patch(ENDPOINTS, ns, "ep-a", {"spec": {"epoch": 2}})   # and keeps it current


def test_a_pod_cannot_publish_another_pods_endpoint(cluster, api: Api, ns: str, pods) -> None:
    as_a = _client_as_pod(cluster, ns, "pod-a")
    with pytest.raises(ApiException) as exc:
        as_a.create(ENDPOINTS, ns, _endpoint("ep-b", pods["pod-b"]))
    assert exc.value.status == 422
    msg = _rejection(exc)
    assert "metadata.ownerReferences" in msg and "'pod-b'" in msg and "'pod-a'" in msg
    assert not api.list(ENDPOINTS, ns)   # nothing was written


def test_a_pod_cannot_overwrite_another_pods_address(cluster, ns: str, pods) -> None:
    _client_as_pod(cluster, ns, "pod-b").create(ENDPOINTS, ns, _endpoint("ep-b", pods["pod-b"]))
    as_a = _client_as_pod(cluster, ns, "pod-a")
    with pytest.raises(ApiException) as exc:
        as_a.patch(ENDPOINTS, ns, "ep-b", {"spec": {"sideChannel": {"host": "10.9.9.9"}}})
    assert exc.value.status == 422 and "a pod may only publish its own" in _rejection(exc)
    assert as_a.get(ENDPOINTS, ns, "ep-b")["spec"]["sideChannel"]["host"] == "10.0.0.1"


def test_a_token_not_bound_to_a_pod_is_refused(cluster, ns: str, pods) -> None:
    unbound = _client_as_pod(cluster, ns, None)
    with pytest.raises(ApiException) as exc:
        unbound.create(ENDPOINTS, ns, _endpoint("ep-a", pods["pod-a"]))
    assert exc.value.status == 422
    assert "authentication.kubernetes.io/pod-name" in _rejection(exc)
