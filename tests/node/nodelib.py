"""Helpers for the real-node tests: chart values for the local images, readiness waits, and
what a container really runs as (read through the host's /proc and the container's mounts).
Agent pods and their control channel are kvbridge_testkit.node_pods', shared with ``make
demo``."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from chartlib import Kube

from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.node_pods import handshakes_succeeded, ready_pod

AGENT_NS = "kvb-agents"
RELEASE, OPERATOR_NS = "kvbridge", "kvbridge-system"
#: Agents spread over both nodes, one KVTransfer pairing them by zone (tests/node/test_cross_node).
ZONES_NS = "kvb-zones"


def wait_rollout(kube: Kube, timeout: int = 180) -> None:
    # kubectl runs under a 60 s limit here: ask in steps shorter than that
    deadline = time.monotonic() + timeout
    while True:
        proc = kube.kubectl("rollout", "status", f"deployment/{RELEASE}", "-n", OPERATOR_NS,
                            "--timeout=45s", check=False)  # fmt: skip
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
    if proc.returncode != 0:
        pods = kube.kubectl("get", "pods", "-n", OPERATOR_NS, "-o", "wide", check=False).stdout
        events = kube.kubectl("get", "events", "-n", OPERATOR_NS, check=False).stdout
        logs = kube.kubectl("logs", f"deployment/{RELEASE}", "-n", OPERATOR_NS, "--tail=40",
                            check=False)  # fmt: skip
        raise AssertionError(f"operator rollout failed: {proc.stderr}\n{pods}\n{events}\n"
                             f"{logs.stdout}{logs.stderr}")


def pod_ip(api: Api, ns: str, name: str) -> str:
    return api.core.read_namespaced_pod(name, ns).status.pod_ip


def wait_pod_ready(api: Api, ns: str, name: str, timeout: float = 120) -> Any:
    return wait_for(lambda: ready_pod(api.core, ns, name), timeout=timeout, interval=0.5,
                    what=f"pod {ns}/{name} Ready")  # fmt: skip


def preflighted(api: Api, pod: str, ns: str = AGENT_NS) -> bool:
    """Every handshake the agent in ``pod`` reports has succeeded, and there is one."""
    return handshakes_succeeded(pod_ip(api, ns, pod))


def container_pid(node: Any, container_id: str) -> int:
    """The host PID of a container's first process, from containerd's task list."""
    cid = container_id.split("://", 1)[-1]
    for line in node.ctr("tasks", "ls").stdout.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == cid:
            return int(parts[1])
    raise LookupError(f"no running task for container {cid}")


def process_identity(pid: int) -> dict[str, Any]:
    """uid/gid, capabilities and the root mount's options of a host PID (the container's view)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    root_opts = ""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        parts = line.split()
        if parts[4] == "/":
            root_opts = parts[5]
    return {
        "uid": [int(x) for x in fields["Uid"].split()],
        "gid": [int(x) for x in fields["Gid"].split()],
        "cap_eff": int(fields["CapEff"].strip(), 16),
        "no_new_privs": fields.get("NoNewPrivs", "").strip() == "1",
        "root_read_only": "ro" in root_opts.split(","),
    }


def read_in_container(pid: int, path: str) -> str:
    """A file as the container sees it (its mount namespace resolves its own symlinks)."""
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "cat", path], capture_output=True,
                          text=True, check=True, timeout=10).stdout  # fmt: skip


TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def token_claims(pid: int) -> dict[str, Any]:
    """The claims of the ServiceAccount token mounted in a container (not verified: read only)."""
    payload = read_in_container(pid, TOKEN_PATH).strip().split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def wait_services_serving(api: Api, namespaces: list[str], timeout: float = 120) -> None:
    """Every Service with a selector in ``namespaces`` has ready endpoints and answers on its
    ClusterIP from the host (routed into the node, translated by kube-proxy): what the node
    controller and the endpoints controller undo while a node is NotReady."""
    import socket

    for ns in namespaces:
        for svc in api.core.list_namespaced_service(ns).items:
            if not svc.spec.selector:
                continue
            name, ip, port = svc.metadata.name, svc.spec.cluster_ip, svc.spec.ports[0].port

            def ready(name: str = name, ns: str = ns) -> bool:
                ep = api.core.read_namespaced_endpoints(name, ns)
                subsets = ep.subsets or []
                return bool(subsets) and all(s.addresses and not s.not_ready_addresses
                                             for s in subsets)  # fmt: skip

            def answers(ip: str = ip, port: int = port) -> bool:
                try:
                    socket.create_connection((ip, port), timeout=2).close()
                except OSError:
                    return False
                return True

            wait_for(ready, timeout=timeout, what=f"Service {ns}/{name} endpoints ready")
            wait_for(answers, timeout=timeout, what=f"Service {ns}/{name} answering at {ip}")
