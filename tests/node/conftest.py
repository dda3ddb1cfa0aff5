"""Fixtures for the real-node tests: one control plane and two kubelet nodes per session
(kvbridge_testkit.node), one pod network over both, the chart installed from the locally built
operator image, and a prefill/decode pair of agent pods on the first node. The second node is
in another zone, holds only the sandbox and agent images, and is tainted so that only pods
meant for it (``nodelib.in_zone``) land there. Missing binaries or images FAIL the session: CI
must run these (``make test`` builds them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from chartlib import CHART, Kube
from nodelib import (
    AGENT_NS,
    OPERATOR_NS,
    RELEASE,
    ZONES_NS,
    preflighted,
    wait_pod_ready,
    wait_rollout,
)

from kvbridge_operator import testing as manifests
from kvbridge_testkit import cluster as kc
from kvbridge_testkit import node as kn
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.node_pods import agent_pod, image_values, two_nodes


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    try:
        return kn.node_images()
    except kn.ImagesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def node_cluster(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[kc.LocalCluster, list[kn.RealNode]]]:  # fmt: skip
    try:
        binaries, node_binaries = kc.Binaries.find(), kn.NodeBinaries.find()
    except kc.StackMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    nodes = two_nodes(images, binaries=node_binaries)
    try:
        for node in nodes:
            node.link_up()
        cluster = kc.LocalCluster(workdir=tmp_path_factory.mktemp("node-cluster"),
                                  binaries=binaries, address=kn.HOST_IP, real_nodes=True,
                                  service_cidr=kn.SERVICE_CIDR)  # fmt: skip
        with cluster:
            try:
                kn.start_all(nodes, cluster)
                yield cluster, nodes
            finally:
                kn.stop_all(nodes)  # before the apiserver goes: pods are deleted through it
    finally:
        kn.stop_all(nodes)


@pytest.fixture(scope="session")
def cluster(node_cluster: tuple[kc.LocalCluster, list[kn.RealNode]]) -> kc.LocalCluster:
    return node_cluster[0]


@pytest.fixture(scope="session")
def node(node_cluster: tuple[kc.LocalCluster, list[kn.RealNode]]) -> kn.RealNode:
    """The first node: the operator, the agents fixture's pods and the vLLM pods run here."""
    return node_cluster[1][0]


@pytest.fixture(scope="session")
def second_node(node_cluster: tuple[kc.LocalCluster, list[kn.RealNode]]) -> kn.RealNode:
    """The second node, in the second zone: only pods that tolerate its taint land here."""
    return node_cluster[1][1]


@pytest.fixture(scope="session")
def kube(cluster: kc.LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Kube:
    return Kube(cluster=cluster, helm_home=tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def api(cluster: kc.LocalCluster) -> Api:
    return Api(cluster.api_client())


@pytest.fixture(scope="session")
def release(kube: Kube, images: dict[str, str]) -> Iterator[str]:
    """The chart, unmodified, installed with the local operator image; agents in AGENT_NS.
    One operator replica (leader election on): these tests follow the operator's pod through
    deletion and upgrade; the hand-over between two replicas is
    tests/e2e/test_operator_leader_election.py's."""
    for ns in (OPERATOR_NS, AGENT_NS, ZONES_NS):
        kube.create_namespace(ns)
    kube.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NS,
              *image_values(images["KVB_IMAGE_OPERATOR"]), "--set", "operator.replicas=1",
              "--set", f"agent.namespaces={{{AGENT_NS},{ZONES_NS}}}", timeout=180)  # fmt: skip
    wait_rollout(kube)
    # Ready pods are not yet a reachable Service: wait until kube-proxy routes the API
    # server's webhook calls to the operator (a server-side dry run goes through the webhook).
    probe = yaml.safe_dump(manifests.transfer_manifest("webhook-probe", AGENT_NS))
    wait_for(lambda: kube.kubectl("apply", "--dry-run=server", "-f", "-", input=probe,
                                  check=False).returncode == 0,
             timeout=60, interval=1, what="the webhook answering through its Service")
    yield RELEASE
    kube.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", check=False)


@pytest.fixture(scope="session")
def agents(api: Api, kube: Kube, release: str, images: dict[str, str]) -> dict[str, str]:
    """A KVTransfer and one prefill and one decode pod from the agent image, Ready and
    preflighted; returns pod name by role."""
    api.create_transfer(AGENT_NS)
    names = {"prefill": "prefill-0", "decode": "decode-0"}
    for role, name in names.items():
        api.core.create_namespaced_pod(AGENT_NS, agent_pod(name, role,
                                                           images["KVB_IMAGE_AGENT"]))
    for name in names.values():
        wait_pod_ready(api, AGENT_NS, name)
    api.wait_condition(AGENT_NS, "Ready", "True", timeout=120)
    wait_for(lambda: preflighted(api, names["decode"]), timeout=60,
             what="decode preflighted its prefill")  # fmt: skip
    return names

