"""Agents as real containers on a real node: pods from the agent image, scheduled by
kube-scheduler, run by the kubelet through containerd, with the pod-bound ServiceAccount token
and the downward API. They publish their KVEndpoints, the operator (itself a pod from the
chart) pairs them, they preflight, and a transfer between the two pods is byte-exact over the
pod network. A killed agent is restarted by the kubelet with a new epoch and the pair re-forms.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import pytest
from nodelib import (
    AGENT_NS,
    container_pid,
    env_of,
    pod_ip,
    preflighted,
    process_identity,
    token_claims,
    wait_pod_ready,
)

from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.node_pods import agent_call, pull_every_block

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.nixl, pytest.mark.slow]
log = logging.getLogger(__name__)



def pull_all(api: Api, names: dict[str, str], request_id: str) -> dict[str, Any]:
    prefill, decode = (pod_ip(api, AGENT_NS, names[r]) for r in ("prefill", "decode"))
    return pull_every_block(decode, prefill, names["prefill"], request_id, timeout_s=20.0)


def test_agent_pods_publish_pair_and_transfer_byte_exact(api: Api, node: Any,
                                                         agents: dict[str, str]) -> None:
    pods = {r: api.core.read_namespaced_pod(n, AGENT_NS) for r, n in agents.items()}
    assert {p.spec.node_name for p in pods.values()} == {node.name}
    ips = {r: p.status.pod_ip for r, p in pods.items()}
    assert len(set(ips.values())) == 2 and all(ip.startswith("10.88.") for ip in ips.values())

    endpoints = api.endpoints(AGENT_NS)
    assert set(endpoints) == set(agents.values())
    for role, name in agents.items():
        ep = endpoints[name]
        owner = ep["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", name,
                                                               pods[role].metadata.uid)
        # Published from the downward API: the pod's own address.
        assert ep["spec"]["sideChannel"]["host"] == ips[role]
        assert ep["spec"]["podName"] == name

    # The container really runs with the pod-bound token (not a legacy Secret token).
    pid = container_pid(node, pods["decode"].status.container_statuses[0].container_id)
    env = env_of(pid)
    assert env["POD_NAME"] == "decode-0" and env["POD_IP"] == ips["decode"]
    claims = token_claims(pid)
    assert claims["kubernetes.io"]["pod"]["name"] == "decode-0"
    assert claims["kubernetes.io"]["serviceaccount"]["name"] == "kvbridge-agent"
    ident = process_identity(pid)
    assert ident["uid"][0] == 65532 and ident["root_read_only"] and ident["cap_eff"] == 0

    result = pull_all(api, agents, "node-r1")
    assert result["ok"] and result["verified"], result
    assert result["nbytes"] == 4 * 64 * 16384
    # Which transport carried it, as the agent reports it: two pods on one node each have a
    # PID namespace of their own, so UCX cannot use cross-memory attach between them and
    # reads over TCP on the pod network (the silent fallback spec.transport.accepted catches).
    [hs] = api.endpoint(AGENT_NS, agents["decode"])["status"]["handshakes"]
    log.warning("pod-to-pod pull: %d bytes in %.2f ms = %.3f GB/s over %s (%s)",
                result["nbytes"], result["seconds"] * 1e3, result["gbps"], hs["transport"],
                hs["transportDetail"])
    assert (hs["peer"], hs["transport"]) == (agents["prefill"], "tcp"), hs
    assert "tcp/eth0" in hs["transportDetail"], hs


def test_killed_agent_restarts_with_new_epoch_and_pair_reforms(api: Api, node: Any,
                                                               agents: dict[str, str]) -> None:
    name = agents["prefill"]
    before = api.endpoint(AGENT_NS, name)["spec"]["epoch"]
    pod = api.core.read_namespaced_pod(name, AGENT_NS)
    restarts = pod.status.container_statuses[0].restart_count
    os.kill(container_pid(node, pod.status.container_statuses[0].container_id), signal.SIGKILL)

    wait_for(lambda: api.core.read_namespaced_pod(name, AGENT_NS).status.container_statuses[0]
             .restart_count > restarts, timeout=60, what="the kubelet restarted the agent")
    time.sleep(1)
    wait_pod_ready(api, AGENT_NS, name)
    after = wait_for(lambda: (lambda e: e if e > before else None)(
        api.endpoint(AGENT_NS, name)["spec"]["epoch"]), timeout=60, what="a new epoch")
    decode_ip = pod_ip(api, AGENT_NS, agents["decode"])
    wait_for(lambda: agent_call(decode_ip, {"cmd": "status"})["peers"].get(name) == after,
             timeout=60, what="decode follows the new epoch")
    wait_for(lambda: preflighted(api, agents["decode"]), timeout=60, what="re-preflighted")
    api.wait_condition(AGENT_NS, "Ready", "True", timeout=60)
    result = pull_all(api, agents, "node-r2")
    assert result["ok"] and result["verified"], result
