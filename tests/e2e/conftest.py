"""e2e fixtures: one real control plane and one operator process per session, a namespace
per test. Missing binaries FAIL the session (CI must run these): run
``bash hack/test-stack.sh ensure`` first.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import kvbridge_cluster as kc
import pytest
from kvb_e2e import REPO, Api, OperatorProcess, wait_for

from kvbridge_operator.config import TRANSFERS
from kvbridge_operator.webhook import self_signed_certificate, webhook_configuration

#: Fake nodes: two zones, for the TopologyAware policy.
NODES = {
    "node-a": {"topology.kubernetes.io/zone": "zone-a"},
    "node-b": {"topology.kubernetes.io/zone": "zone-b"},
}
OPERATOR_NS, OPERATOR_SA = "kvbridge-system", "kvbridge-operator"


@pytest.fixture(scope="session")
def cluster() -> Iterator[kc.LocalCluster]:
    try:
        binaries = kc.Binaries.find()
    except kc.StackMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    with kc.LocalCluster(binaries=binaries) as c:
        c.kubectl("apply", "-f", str(REPO / "crds"))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        with kc.FakeKubelet(c.api_client(), NODES):
            yield c


@pytest.fixture(scope="session")
def api(cluster: kc.LocalCluster) -> Api:
    return Api(cluster.api_client())


@pytest.fixture(scope="session")
def operator(cluster: kc.LocalCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:  # fmt: skip
    """The operator as a separate process with the least-privilege ServiceAccount token."""
    work = tmp_path_factory.mktemp("operator")
    k = cluster.kubectl
    k("create", "namespace", OPERATOR_NS)
    k("create", "serviceaccount", OPERATOR_SA, "-n", OPERATOR_NS)
    k("apply", "-f", str(REPO / "hack" / "operator-rbac.yaml"))
    k("create", "clusterrolebinding", "kvbridge-operator", "--clusterrole=kvbridge-operator",
      f"--serviceaccount={OPERATOR_NS}:{OPERATOR_SA}")  # fmt: skip
    k("apply", "-f", "-", input="apiVersion: kopf.dev/v1\nkind: ClusterKopfPeering\n"
      "metadata: {name: kvbridge}\n")  # fmt: skip
    token = cluster.service_account_token(OPERATOR_NS, OPERATOR_SA)
    kubeconfig = cluster.kubeconfig_for_token(token, "operator")
    ports = {"metrics": kc.free_port(), "liveness": kc.free_port(), "webhook": kc.free_port()}
    cert, key = self_signed_certificate(work, ["127.0.0.1", "localhost"])
    env = {
        "KVBRIDGE_METRICS_PORT": str(ports["metrics"]),
        "KVBRIDGE_METRICS_ADDR": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_PORT": str(ports["webhook"]),
        "KVBRIDGE_WEBHOOK_ADDR": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_HOST": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_CERT": str(cert),
        "KVBRIDGE_WEBHOOK_KEY": str(key),
        "KVBRIDGE_DEBOUNCE": "0.1",
    }
    op = OperatorProcess(kubeconfig, work, env, ports)
    op.start()
    vwc = webhook_configuration(
        "kvbridge-validation", Path(cert).read_bytes(), url=f"https://127.0.0.1:{ports['webhook']}"
    )
    cluster.api_client()  # urllib3 warnings off
    from kubernetes import client

    client.AdmissionregistrationV1Api(cluster.api_client()).create_validating_webhook_configuration(
        vwc
    )
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def ns(request: pytest.FixtureRequest, cluster: kc.LocalCluster, api: Api,
       operator: OperatorProcess) -> Iterator[str]:  # fmt: skip
    """A fresh namespace; KVTransfers are deleted (finalizer) before the namespace."""
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    api.core.create_namespace({"metadata": {"name": name}})
    yield name
    for t in api.list(TRANSFERS, name):
        api.delete(TRANSFERS, name, t["metadata"]["name"])
    wait_for(lambda: not api.list(TRANSFERS, name), timeout=30, what="KVTransfers deleted")
    api.core.delete_namespace(name)
