"""Simulated pods for the demo and the e2e tests: a real Pod object (made Running by the
node simulator, ``hack/kc.FakeKubelet``) backed by a real agent process
(``kvbridge_testkit/pod_agent.py``) that authenticates with a token bound to that Pod.

Every wait has a deadline; :meth:`SimPod.stop` / :meth:`SimPod.kill` end only the process
this module started.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbridge_testkit import REPO

#: Run as a script (as the agent image runs it), not imported.
POD_AGENT = Path(__file__).resolve().with_name("pod_agent.py")

#: The agent Role of the Helm chart (charts/kvbridge/templates/_helpers.tpl agentRules), for
#: tests that do not install the chart.
AGENT_RULES = [
    {"apiGroups": ["kvbridge.io"], "resources": ["kvendpoints"],
     "verbs": ["create", "get", "update", "patch"]},
    {"apiGroups": ["kvbridge.io"], "resources": ["kvendpoints/status"],
     "verbs": ["get", "update", "patch"]},
    {"apiGroups": ["kvbridge.io"], "resources": ["kvtransfers"],
     "verbs": ["get", "list", "watch"]},
]


class AgentError(RuntimeError):
    """The agent process exited, answered with an error, or missed a deadline."""


def create_agent_rbac(api_client: Any, namespace: str, sa: str = "kvbridge-agent") -> None:
    """ServiceAccount + Role + RoleBinding equal to the chart's agent RBAC."""
    from kubernetes import client

    core, rbac = client.CoreV1Api(api_client), client.RbacAuthorizationV1Api(api_client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": sa}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": sa}, "rules": AGENT_RULES})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]})


def pod_bound_token(kubectl: Any, namespace: str, sa: str, pod: str, seconds: int = 3600
                    ) -> str:
    """``kubectl create token SA --bound-object-kind Pod --bound-object-name POD``."""
    return kubectl("create", "token", sa, "-n", namespace, "--bound-object-kind", "Pod",
                   "--bound-object-name", pod, f"--duration={seconds}s").stdout.strip()


class SimPod:
    """One simulated serving pod: Pod object + agent process.

    Args:
        cluster: a ``kvbridge_testkit.cluster.LocalCluster`` (admin, for pods and tokens).
        namespace / name / role / engine_id / preset / seed: the pod and its agent.
        sa: the workload ServiceAccount the pod runs as.
        host: side-channel bind/advertise address (loopback, or a netns address).
        netns: run the agent inside this network namespace (``ip netns exec``).
        log_dir: where the agent's stderr goes.
        api_server: the apiserver URL the agent uses (default the cluster's; e.g. a proxy).
    """

    def __init__(self, cluster: Any, namespace: str, name: str, *, role: str, engine_id: str,
                 transfer: str = "kvt", preset: str = "grouped", seed: int = 1,
                 sa: str = "kvbridge-agent", host: str = "127.0.0.1",
                 netns: str | None = None, log_dir: Path | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 api_server: str = "") -> None:
        from kubernetes import client

        self.cluster = cluster
        self.core = client.CoreV1Api(cluster.api_client())
        self.namespace, self.name, self.role = namespace, name, role
        self.engine_id, self.transfer, self.preset, self.seed = engine_id, transfer, preset, seed
        self.sa, self.host, self.netns = sa, host, netns
        self.log_dir = log_dir or Path(cluster.workdir) / "agents"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.api_server = api_server
        self.proc: subprocess.Popen[str] | None = None
        self.uid = ""
        self.ready: dict[str, Any] = {}
        self.starts = 0
        self._lines: queue.Queue[str | None] = queue.Queue()

    # -- the Pod object ------------------------------------------------------------------------
    def create_pod(self, timeout: float = 30.0) -> SimPod:
        self.core.create_namespaced_pod(self.namespace, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "labels": {"kvbridge.io/role": self.role,
                                                       "kvbridge.io/agent": "true"}},
            "spec": {"serviceAccountName": self.sa, "shareProcessNamespace": True,
                     "containers": [{"name": "vllm", "image": "vllm/vllm-openai:sim"}]},
        })
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pod = self.core.read_namespaced_pod(self.name, self.namespace)
            if pod.status.phase == "Running":
                self.uid, self.node = pod.metadata.uid, pod.spec.node_name
                return self
            time.sleep(0.1)
        raise AgentError(f"pod {self.namespace}/{self.name} not Running within {timeout} s")

    def delete_pod(self) -> None:
        self.core.delete_namespaced_pod(self.name, self.namespace)

    @property
    def metrics_target(self) -> str:
        """host:port of the agent's metrics ("" when it serves none)."""
        port = self.ready.get("metrics_port")
        return f"127.0.0.1:{port}" if port else ""

    # -- the agent process ---------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.namespace}-{self.name}-{self.starts}.log"

    def start(self, timeout: float = 60.0) -> dict[str, Any]:
        """Start the agent (mints a fresh pod-bound token); returns its ready line."""
        if not self.uid:
            self.create_pod()
        self.starts += 1
        token = pod_bound_token(self.cluster.kubectl, self.namespace, self.sa, self.name)
        kubeconfig = self.cluster.kubeconfig_for_token(
            token, f"pod-{self.namespace}-{self.name}", server=self.api_server)
        cmd = [sys.executable, str(POD_AGENT), "--kubeconfig", str(kubeconfig),
               "--transfer", self.transfer, "--role", self.role, "--engine-id", self.engine_id,
               "--preset", self.preset, "--seed", str(self.seed), "--host", self.host,
               *self.extra_args]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd, "--api-uds", self._api_bridge()]
        env = {**os.environ, "POD_NAME": self.name, "POD_UID": self.uid,
               "POD_NAMESPACE": self.namespace, "NODE_NAME": getattr(self, "node", ""),
               "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("KUBECONFIG", None)
        if self.netns:   # UCX must use the namespace's own interface, not loopback
            env.pop("UCX_NET_DEVICES", None)
            env["UCX_NET_DEVICES"] = self.env.get("UCX_NET_DEVICES", "all")
        else:
            env.setdefault("UCX_NET_DEVICES", "lo")
        self._lines = queue.Queue()
        log = open(self.log_path, "w")   # noqa: SIM115 - owned by the process lifetime
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, env=env, cwd=str(REPO))
        log.close()
        threading.Thread(target=self._reader, args=(self.proc, self._lines),
                         daemon=True).start()
        self.ready = self._read(timeout)
        if self.ready.get("event") != "ready":
            raise AgentError(f"{self.name}: unexpected first line {self.ready}")
        return self.ready

    def _api_bridge(self) -> str:
        from urllib.parse import urlparse

        from kvbridge_testkit.bridge import unix_to_tcp

        path = str(self.log_dir / f"api-{self.namespace}-{self.name}.sock")
        if getattr(self, "_bridge", None) is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            url = urlparse(self.cluster.server)
            self._bridge = unix_to_tcp(path, url.hostname or "127.0.0.1", url.port or 443)
        return path

    def close(self) -> None:
        """Stop the agent and the apiserver bridge (the Pod object is left alone)."""
        self.stop()
        bridge = getattr(self, "_bridge", None)
        if bridge is not None:
            bridge.close()
            self._bridge = None

    @staticmethod
    def _reader(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AgentError(f"{self.name}: no answer within {timeout} s; log:\n"
                             f"{self.log_tail()}") from None
        if line is None:
            raise AgentError(f"{self.name}: agent exited; log:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def call(self, cmd: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            raise AgentError(f"{self.name}: agent is not running")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout)
        if "error" in out:
            raise AgentError(f"{self.name}: {cmd}: {out['error']}")
        return out

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def stop(self, timeout: float = 15.0) -> None:
        """Graceful exit (closes NIXL); falls back to SIGKILL of this process."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", timeout=timeout)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
        self.proc = None

    def restart(self, timeout: float = 60.0) -> dict[str, Any]:
        """Kill the agent process (a crash) and start it again in the same pod."""
        self.kill()
        return self.start(timeout)


def wait_until(fn: Any, *, timeout: float, interval: float = 0.1, what: str = "condition"
               ) -> Any:
    """Poll ``fn`` until truthy; raise AgentError with the last value at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except Exception as exc:   # transient API errors while objects appear/disappear
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AgentError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def handshakes_ok(pod: SimPod, peers: int = 1) -> bool:
    """True when the agent reports ``peers`` successful handshakes and loaded peers."""
    st = pod.status()
    ok = [h for h in st["handshakes"] if h["state"] == "Succeeded"]
    return len(ok) >= peers and len(st["peers"]) >= peers
