"""Fault-test fixtures: a control plane and an operator of their OWN per module (the tests
restart etcd and kube-apiserver and kill the operator, which would disturb the shared e2e
session), one namespace with real agents: prefill ``p-0`` and decode ``d-0``, the decode one
talking to the apiserver through a :class:`faultlib.TcpProxy` that a test can cut.

Missing binaries FAIL the module (CI must run these): ``bash hack/test-stack.sh ensure``.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from faultlib import NS, Agents, TcpProxy

from kvbridge_testkit import cluster as kc
from kvbridge_testkit.e2e import Api, crd_cluster, deploy_operator, wait_for
from kvbridge_testkit.operator_process import OperatorProcess
from kvbridge_testkit.sim import create_agent_rbac, handshakes_ok

NODES = {"node-a": {"topology.kubernetes.io/zone": "zone-a"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kc.LocalCluster]:
    with crd_cluster(NODES, tmp_path_factory.mktemp("faults-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster: kc.LocalCluster) -> Api:
    return Api(cluster.api_client())


@pytest.fixture(scope="module")
def operator(cluster: kc.LocalCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:  # fmt: skip
    """kopf at debug level: its watch restarts (410 Gone) are logged only there. ``POD_NAME``
    is the operator's Lease identity, as the chart sets it: a restart of the process is a
    container restart in the same pod, which holds the Lease again at once. (A new identity
    would wait for its SIGKILLed predecessor's Lease to expire.) The Lease lasts longer than
    any fault here keeps the operator from renewing it (a frozen process, an API server down
    for seconds): one replica with no kubelet to restart it must not give up its term.
    A debounce of 0.3 s (0.2 s by default) leaves the SIGKILL test a window to land in."""
    op = deploy_operator(cluster, tmp_path_factory.mktemp("faults-operator"),
                         {"POD_NAME": "kvbridge-operator-faults", "KVBRIDGE_DEBOUNCE": "0.3",
                          "KVBRIDGE_LEASE_DURATION": "300", "KVBRIDGE_LEASE_RENEW_DEADLINE": "240"},
                         extra_args=["--debug"])  # fmt: skip
    try:
        yield op
    finally:
        if op.proc is not None:
            op.resume()  # a test may fail while it is frozen
        op.stop()


@pytest.fixture(scope="module")
def agents(cluster: kc.LocalCluster, api: Api, operator: OperatorProcess) -> Iterator[Agents]:
    api.core.create_namespace({"metadata": {"name": NS}})
    create_agent_rbac(cluster.api_client(), NS)
    api.create_transfer(NS, pairing={"prefillPerDecode": 2})
    url = urlparse(cluster.server)
    made = Agents(cluster, TcpProxy(url.hostname or "127.0.0.1", url.port or 443))
    try:
        p = made.start("p-0", "prefill", "P0")
        d = made.start("d-0", "decode", "D0", api_server=made.proxy.url)
        wait_for(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=90, what="preflight")
        yield made
    finally:
        for pod in made.pods.values():
            pod.close()
        made.proxy.close()
