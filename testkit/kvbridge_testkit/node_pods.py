"""Serving pods on real nodes (kvbridge_testkit.node): the agent image's engine stand-in
(pod_agent.py) as a real container, and a handle that drives it over its TCP control
port. Used by ``make demo`` on a real node and by tests/node."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

CONTROL_PORT = 7000
#: The agent's Prometheus metrics, on the container port the chart's PodMonitor scrapes.
METRICS_PORT = 9400
AGENT_SA = "kvbridge-agent"
#: The seed of the prefill's memory pattern (``agent_pod``'s default), which pulls verify.
PATTERN_SEED = 7
#: Every block of both transfer groups of the agent's ``grouped`` preset: 4 regions of 64
#: blocks of 16 KiB, 4 MiB in 256 descriptors.
ALL_BLOCKS = [list(range(64)), list(range(64))]
ZONE_KEY = "topology.kubernetes.io/zone"
ZONES = ("zone-a", "zone-b")  # the first node's, the second node's
#: The second node holds only the sandbox and agent images: only pods placed there on purpose
#: (``in_zone``) may land on it.
SECOND_NODE_TAINT_KEY = "kvbridge.io/agent-images-only"
SECOND_NODE_TAINT = f"{SECOND_NODE_TAINT_KEY}=true:NoSchedule"


def in_zone(pod: dict[str, Any], zone: str) -> dict[str, Any]:
    """``pod`` placed by kube-scheduler onto a node of ``zone`` (its real node label),
    tolerating the second node's taint."""
    pod["spec"]["nodeSelector"] = {ZONE_KEY: zone}
    pod["spec"]["tolerations"] = [{"key": SECOND_NODE_TAINT_KEY, "operator": "Exists",
                                   "effect": "NoSchedule"}]  # fmt: skip
    return pod


def agent_pod(name: str, role: str, image: str, *, engine_id: str | None = None,
              seed: int = PATTERN_SEED, preset: str = "grouped", transfer: str = "kvt",
              service_account: str = AGENT_SA) -> dict[str, Any]:  # fmt: skip
    """A serving pod as a user would write it: the agent image, the pod-bound ServiceAccount
    token, the downward API, non-root on a read-only root filesystem."""

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "kvb-agent", "kvbridge.io/role": role,
                                                "kvbridge.io/agent": "true"}},
        "spec": {
            "serviceAccountName": service_account,
            "terminationGracePeriodSeconds": 2,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
            "containers": [{
                "name": "agent",
                "image": image,
                "imagePullPolicy": "Never",
                "args": ["--transfer", transfer, "--role", role,
                         "--engine-id", engine_id or name, "--preset", preset,
                         "--seed", str(seed), "--control-port", str(CONTROL_PORT),
                         "--metrics-port", str(METRICS_PORT), "--metrics-addr", "0.0.0.0"],
                "env": [
                    {"name": "POD_NAME", **field("metadata.name")},
                    {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                    {"name": "POD_UID", **field("metadata.uid")},
                    {"name": "POD_IP", **field("status.podIP")},
                    {"name": "NODE_NAME", **field("spec.nodeName")},
                    # UCX may use every device the pod has (the agent reports which
                    # transport it picks in the KVEndpoint's status.handshakes).
                    {"name": "UCX_NET_DEVICES", "value": "all"},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                ],
                "ports": [{"name": "control", "containerPort": CONTROL_PORT},
                          {"name": "kvb-metrics", "containerPort": METRICS_PORT}],
                "readinessProbe": {"tcpSocket": {"port": "control"}, "periodSeconds": 1},
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }  # fmt: skip


def two_nodes(images: dict[str, str], **node_args: Any) -> list[Any]:
    """The two nodes ``make demo``, tests/node and bench/bench_pods.py run: the first in
    ``zone-a`` with every image, the second in ``zone-b``, tainted, with the sandbox and agent
    images only (the vLLM image stays on the first). Not started: ``link_up`` both, start the
    control plane, ``start`` both, then ``kvbridge_testkit.node.connect`` them."""
    from kvbridge_testkit import node as kn

    second_images = [Path(images[k]) for k in ("KVB_IMAGE_PAUSE_TAR", "KVB_IMAGE_AGENT_TAR")]
    return [kn.RealNode(images=kn.image_archives(images), labels={ZONE_KEY: ZONES[0]},
                        **node_args),
            kn.RealNode(images=second_images, labels={ZONE_KEY: ZONES[1]},
                        taints=[SECOND_NODE_TAINT], index=1, **node_args)]  # fmt: skip


def image_values(image: str) -> list[str]:
    """``helm --set`` arguments that run the chart's operator from a locally imported image."""
    repository, tag = image.rsplit(":", 1)
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never"]  # fmt: skip


def ready_pod(core: Any, namespace: str, name: str) -> Any:
    """The pod when its Ready condition is True, else None (one check, for a poll loop)."""
    pod = core.read_namespaced_pod(name, namespace)
    conditions = {c.type: c.status for c in pod.status.conditions or []}
    return pod if conditions.get("Ready") == "True" else None


def agent_call(pod_ip: str, cmd: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """One JSON-line command to a pod agent's control port (a fresh connection each time)."""
    with socket.create_connection((pod_ip, CONTROL_PORT), timeout=timeout) as conn:
        stream = conn.makefile("rw", encoding="utf-8")
        stream.write(json.dumps(cmd) + "\n")
        stream.flush()
        line = stream.readline()
    if not line:
        raise ConnectionError(f"agent at {pod_ip} closed the connection on {cmd}")
    reply = json.loads(line)
    if "error" in reply:
        raise RuntimeError(f"agent at {pod_ip}: {reply['error']}")
    return reply


def handshakes_succeeded(pod_ip: str) -> bool:
    """The agent at ``pod_ip`` reports a handshake, and every one it reports succeeded."""
    shakes = agent_call(pod_ip, {"cmd": "status"})["handshakes"]
    return bool(shakes) and all(h["state"] == "Succeeded" for h in shakes)


def pull_every_block(decode_ip: str, prefill_ip: str, prefill_engine: str, request_id: str,
                     timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """The decode's memory cleared, then every block of the prefill read through the agent and
    compared byte for byte with the prefill's seeded pattern (``verified`` in the reply)."""
    agent_call(decode_ip, {"cmd": "clear"})
    agent_call(prefill_ip, {"cmd": "hold", "request_ids": [request_id]})
    return agent_call(decode_ip, {
        "cmd": "pull", "request_id": request_id, "remote_engine_id": prefill_engine,
        "local_block_ids": ALL_BLOCKS, "remote_block_ids": ALL_BLOCKS,
        "verify_seed": PATTERN_SEED, "timeout_s": timeout_s})  # fmt: skip


def bench_pull(decode_ip: str, prefill_ip: str, prefill_engine: str, reps: int,
               timeout: float) -> dict[str, Any]:  # fmt: skip
    """The decode pod's ``bench_pull`` over every block (pod_agent.py): medians of the
    agent's pull, a raw NIXL READ of the same descriptors and that READ with the notification
    (``*_gbps``, ``*_ms``); ``ratio`` is the agent's throughput over the raw READ's. The raw
    READ's bytes are verified too. The prefill holds every request id the reps use."""
    request_id = f"bench-{decode_ip}"
    agent_call(prefill_ip, {"cmd": "hold", "request_ids": [
        f"{request_id}-{rep}{notified}" for rep in range(reps) for notified in ("", "-n")]})
    return agent_call(decode_ip, {
        "cmd": "bench_pull", "request_id": request_id, "remote_engine_id": prefill_engine,
        "local_block_ids": ALL_BLOCKS, "remote_block_ids": ALL_BLOCKS, "reps": reps,
        "verify_seed": PATTERN_SEED, "timeout_s": 30.0}, timeout=timeout)  # fmt: skip


class NodePod:
    """A running agent pod, driven like sim.SimPod: ``call(cmd, **kw)``, ``status()``."""

    def __init__(self, name: str, ip: str, *, engine_id: str | None = None,
                 preset: str = "grouped") -> None:  # fmt: skip
        self.name, self.ip, self.preset = name, ip, preset
        self.engine_id = engine_id or name

    def call(self, cmd: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        return agent_call(self.ip, {"cmd": cmd, **kw}, timeout=timeout)

    def status(self) -> dict[str, Any]:
        return self.call("status")

    @property
    def metrics_target(self) -> str:
        """host:port where Prometheus scrapes this pod's agent (the pod IP)."""
        return f"{self.ip}:{METRICS_PORT}"
