"""Last in the node session (files run in name order): a deleted pod's KVEndpoint is garbage
collected by the real controller, ``helm uninstall`` leaves nothing running, and stopping the
nodes leaves no bridge, veth, iptables rule, network namespace, mount, cgroup or containerd
task of either node behind on the host; and what a crashed run left is cleared before the
next node."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from chartlib import Kube
from nodelib import AGENT_NS, OPERATOR_NS, RELEASE

from kvbridge_operator.config import ENDPOINTS
from kvbridge_testkit import node as kn
from kvbridge_testkit.e2e import Api, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.slow]


def test_deleted_agent_pod_garbage_collects_its_endpoint(api: Api, node: Any,
                                                         agents: dict[str, str]) -> None:
    name = agents["decode"]
    assert name in api.endpoints(AGENT_NS)
    api.core.delete_namespaced_pod(name, AGENT_NS)
    wait_for(lambda: name not in {e["metadata"]["name"] for e in api.list(ENDPOINTS, AGENT_NS)},
             timeout=90, what="the KVEndpoint garbage-collected with its pod")  # fmt: skip
    wait_for(lambda: not [p for p in api.core.list_namespaced_pod(AGENT_NS).items
                          if p.metadata.name == name], timeout=60, what="pod gone")  # fmt: skip
    api.wait_condition(AGENT_NS, "Ready", "False", timeout=60)


def test_helm_uninstall_leaves_nothing_running(api: Api, kube: Kube, node: Any,
                                               release: str) -> None:
    tasks_before = set(node.ctr("tasks", "ls", "-q").stdout.split())
    operator_containers = {
        c.container_id.split("://")[-1]
        for p in api.core.list_namespaced_pod(OPERATOR_NS).items
        for c in p.status.container_statuses or []
    }
    assert operator_containers & tasks_before
    kube.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "120s")
    wait_for(lambda: not api.core.list_namespaced_pod(OPERATOR_NS).items, timeout=90,
             what="no pods left in the release namespace")  # fmt: skip
    wait_for(lambda: not operator_containers & set(node.ctr("tasks", "ls", "-q").stdout.split()),
             timeout=60, what="the operator's containers stopped")  # fmt: skip
    for kind in ("deployment", "service", "validatingwebhookconfiguration", "clusterrole"):
        out = kube.kubectl("get", kind, "-A", "-l", f"app.kubernetes.io/instance={RELEASE}",
                           "-o", "name").stdout  # fmt: skip
        assert not out.strip(), f"left after uninstall: {out}"


def test_stopped_nodes_leave_nothing_on_the_host(api: Api, node: Any, second_node: Any) -> None:
    """Both nodes stop (the second first, as the fixture does): no link, route, namespace,
    mount, cgroup, shim or daemon of either is left, and the host's iptables rules and sysctls
    (``ip_forward`` among them) are as they were before the first node came up."""
    for pod in api.core.list_namespaced_pod(AGENT_NS).items:  # still running: stop() drains
        assert pod.spec.node_name == node.name
    kn.stop_all([node, second_node])
    for n in (second_node, node):
        leftovers = n.leftovers()
        assert leftovers == {k: [] for k in leftovers}, (n.name, leftovers)


@pytest.mark.parametrize("index", [0, 1], ids=["first-node", "second-node"])
def test_a_crashed_runs_leftovers_are_cleared_and_a_live_node_is_never_touched(
        index: int) -> None:  # fmt: skip
    """A node killed without its teardown (a CI job cut off mid-run) leaves its link, routes,
    namespaces and mounts; the next node clears them, but refuses while a process lives there."""
    net = kn.NodeNet(index)
    crashed = kn.RealNode(images=[], index=index).link_up()  # no teardown: the "crash"
    stale_pod_netns = "cni-kvbtest-crashed"
    subprocess.run(["ip", "netns", "add", stale_pod_netns], check=True)
    net.run_dir.mkdir(parents=True, exist_ok=True)
    (net.run_dir / "shm").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(net.run_dir / "shm")], check=True)
    survivor = subprocess.Popen(["ip", "netns", "exec", net.netns, "sleep", "300"])
    nxt = kn.RealNode(images=[], index=index)
    try:
        wait_for(lambda: str(survivor.pid) in _netns_pids(net.netns), timeout=10,
                 what="a process inside the crashed node's namespace")  # fmt: skip
        refusal = rf"another node runs here: processes .*{survivor.pid}"
        with pytest.raises(kn.NodeError, match=refusal):
            nxt.link_up()
        assert Path(f"/run/netns/{net.netns}").exists()  # refused: nothing was removed
        assert (net.run_dir / "shm").is_mount()
        survivor.kill()
        survivor.wait()
        nxt.link_up()
        assert not Path(f"/run/netns/{stale_pod_netns}").exists()
        assert not net.run_dir.exists()
        assert crashed.workdir is not None and not crashed.workdir.exists()
    finally:
        survivor.kill()
        nxt.stop()
        subprocess.run(["ip", "netns", "del", stale_pod_netns], check=False, capture_output=True)
    leftovers = nxt.leftovers()
    assert leftovers == {k: [] for k in leftovers}, leftovers


def _netns_pids(name: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True
                          ).stdout.split()  # fmt: skip
