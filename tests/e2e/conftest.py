"""e2e fixtures: one real control plane and one operator process per session, a namespace
per test. Missing binaries FAIL the session (CI must run these): run
``bash hack/test-stack.sh ensure`` first.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from kvbridge_operator.config import TRANSFERS
from kvbridge_testkit import cluster as kc
from kvbridge_testkit.e2e import Api, crd_cluster, deploy_operator, wait_for
from kvbridge_testkit.operator_process import OperatorProcess

#: Fake nodes: two zones, for the TopologyAware policy.
NODES = {
    "node-a": {"topology.kubernetes.io/zone": "zone-a"},
    "node-b": {"topology.kubernetes.io/zone": "zone-b"},
}


@pytest.fixture(scope="session")
def cluster() -> Iterator[kc.LocalCluster]:
    with crd_cluster(NODES) as c:
        yield c


@pytest.fixture(scope="session")
def api(cluster: kc.LocalCluster) -> Api:
    return Api(cluster.api_client())


@pytest.fixture(scope="session")
def operator(cluster: kc.LocalCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:  # fmt: skip
    """The operator as a separate process with the least-privilege ServiceAccount token."""
    op = deploy_operator(cluster, tmp_path_factory.mktemp("operator"), {"KVBRIDGE_DEBOUNCE": "0.1"})
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
