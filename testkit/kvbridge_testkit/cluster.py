"""A real, local Kubernetes v1.20.2 control plane for tests, chart checks and the demo.

``LocalCluster`` starts etcd, kube-apiserver and kube-controller-manager (garbage collector,
namespace, service-account and workload controllers) as child processes on free loopback
ports, with a temporary data directory, an admin token, RBAC authorization and service-account
signing keys, and writes an admin kubeconfig. ``FakeKubelet`` plays the node: it registers
Ready Nodes, binds Pending pods, marks them Running/Ready with a podIP and finishes pod
deletion. With ``real_nodes=True`` it also runs kube-scheduler and serves real kubelets
(:mod:`kvbridge_testkit.node`): ServiceAccount admission with pod-bound tokens, the ``kubernetes``
Service's endpoints, and the endpoint, root-CA and node-lifecycle controllers. Binaries come
from ``hack/test-stack.sh ensure``.

Threads: ``FakeKubelet`` runs one daemon thread with a pod watch (reconnecting on expiry);
``stop()`` sets an event and closes the watch. Every wait has a deadline.

CLI (for a demo or by hand)::

    python -m kvbridge_testkit.cluster up      # prints KUBECONFIG=..., Ctrl-C tears down
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge_testkit import HACK

KUBE_VERSION = "v1.20.2"
CACHE = Path(os.environ.get("KVB_CACHE", "/var/cache/kvbridge"))
ENSURE_HINT = (
    f"run `bash {HACK / 'test-stack.sh'} ensure` as root first (builds Kubernetes "
    f"{KUBE_VERSION}'s control plane, kubelet and kube-proxy once, ~8 minutes, installs the "
    f"node's containerd, and fetches kubectl/helm)"
)


class StackMissingError(RuntimeError):
    """A test-stack binary is missing; the message says how to install it."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    helm: Path
    kube_scheduler: Path | None = None

    @classmethod
    def find(cls) -> Binaries:
        """Locate the binaries (env overrides ``KVB_KUBE_APISERVER`` ...) or raise."""
        kube = CACHE / f"kube-{KUBE_VERSION}"
        candidates = {
            "etcd": os.environ.get("KVB_ETCD") or shutil.which("etcd") or "/usr/bin/etcd",
            "kube_apiserver": os.environ.get("KVB_KUBE_APISERVER") or kube / "kube-apiserver",
            "kube_controller_manager": os.environ.get("KVB_KUBE_CONTROLLER_MANAGER")
            or kube / "kube-controller-manager",
            "kubectl": os.environ.get("KVB_KUBECTL") or CACHE / "bin" / "kubectl",
            "helm": os.environ.get("KVB_HELM") or CACHE / "bin" / "helm",
        }
        paths = {k: Path(v) for k, v in candidates.items()}
        missing = [f"{k}={p}" for k, p in paths.items() if not os.access(p, os.X_OK)]
        if missing:
            raise StackMissingError(
                f"test stack binaries missing ({', '.join(missing)}): {ENSURE_HINT}"
            )
        scheduler = Path(os.environ.get("KVB_KUBE_SCHEDULER") or kube / "kube-scheduler")
        return cls(**paths, kube_scheduler=scheduler if os.access(scheduler, os.X_OK) else None)


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free TCP port for a child process to bind later, below the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: until the child binds it, any outgoing
    connection on the machine may be given it ("Address already in use"). Ports below the
    range are only taken by explicit binds; each is handed out once per process.
    """
    low = _ephemeral_low()
    rng = secrets.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


@dataclass
class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager on loopback; see the module docstring.

    Use as a context manager or call :meth:`start`/:meth:`stop`. ``kubeconfig`` is an admin
    kubeconfig (static token in group system:masters). :meth:`restart` stops and starts one
    component in place (the fault tests); ``etcd_url`` is etcd's client URL.
    """

    workdir: Path | None = None
    controllers: str = (
        "garbagecollector,namespace,serviceaccount,serviceaccount-token,deployment,replicaset"
    )
    #: Address the apiserver binds and advertises; a real node needs one its pods can reach.
    address: str = "127.0.0.1"
    #: Serve real kubelets (kvbridge_testkit.node): kube-scheduler, the ServiceAccount admission
    #: plugin with pod-bound projected tokens, the ``kubernetes`` Service's endpoints, and the
    #: endpoint and root-CA controllers. Off, pods are played by ``FakeKubelet``.
    real_nodes: bool = False
    service_cidr: str = "10.0.0.0/24"
    binaries: Binaries = field(default_factory=Binaries.find)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _owns_workdir: bool = False

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvb-cluster-"))
            self._owns_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.etcd_url = ""  # http://127.0.0.1:<client port>, set by start()
        self.server = f"https://{self.address}:{self.port}"
        self.kubeconfig = self.workdir / "admin.kubeconfig"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> LocalCluster:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        wd = self.workdir
        assert wd is not None
        logs = wd / "logs"
        logs.mkdir(exist_ok=True)
        etcd_client, etcd_peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{etcd_client}"
        self._spawn(
            "etcd",
            [
                str(self.binaries.etcd), "--data-dir", str(wd / "etcd"), "--name", "kvb",
                "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster", f"kvb=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync", "--log-level", "warn",
            ],
            logs,
        )  # fmt: skip
        (wd / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        sa_key, sa_pub = wd / "sa.key", wd / "sa.pub"
        _run(["openssl", "genrsa", "-out", str(sa_key), "2048"])
        _run(["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub)])
        if self.real_nodes:
            node_flags = ["--endpoint-reconciler-type=lease",
                          "--feature-gates=BoundServiceAccountTokenVolume=true",
                          # logs/exec reach kubelets by address: no name lookups
                          "--kubelet-preferred-address-types=InternalIP"]
        else:
            node_flags = ["--endpoint-reconciler-type=none",
                          "--disable-admission-plugins=ServiceAccount"]
        self._spawn(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                f"--bind-address={self.address}", f"--secure-port={self.port}",
                "--insecure-port=0", f"--advertise-address={self.address}",
                f"--cert-dir={wd / 'pki'}", f"--token-auth-file={wd / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={self.service_cidr}",
                *node_flags,
                "--enable-priority-and-fairness=false", "--allow-privileged=true",
                "--profiling=false", "-v=0",
            ],
            logs,
        )  # fmt: skip
        self._wait_ready(time.monotonic() + timeout)
        self._write_kubeconfig(self.kubeconfig, self.token, user="admin")
        controllers = self.controllers
        gates: list[str] = []
        if self.real_nodes:
            controllers += ",endpoint,endpointslice,root-ca-cert-publisher,podgc,nodelifecycle"
            gates = ["--feature-gates=BoundServiceAccountTokenVolume=true"]
            scheduler = self.binaries.kube_scheduler
            if scheduler is None:
                raise StackMissingError(f"kube-scheduler missing: {ENSURE_HINT}")
            self._spawn(
                "kube-scheduler",
                [str(scheduler), f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                 "--port=0", "--secure-port=0", "--profiling=false", "-v=0"],
                logs,
            )  # fmt: skip
        self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.kube_controller_manager), *gates,
                f"--kubeconfig={self.kubeconfig}", f"--controllers={controllers}",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={wd / 'pki' / 'apiserver.crt'}",
                "--leader-elect=false", "--port=0", "--secure-port=0",
                "--use-service-account-credentials=false", "--profiling=false",
                "--concurrent-gc-syncs=20", "-v=0",
            ],
            logs,
        )  # fmt: skip

    def _spawn(self, name: str, cmd: list[str], logs: Path, index: int | None = None) -> None:
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        proc.name = name  # type: ignore[attr-defined]
        if index is None:
            self._procs.append(proc)
        else:
            self._procs[index] = proc

    def restart(self, name: str, *, sig: int = signal.SIGTERM, down_s: float = 0.0,
                timeout: float = 90.0) -> None:
        """Stop component ``name`` with ``sig`` and start it again with the same flags, ports
        and data directory (etcd keeps its data); waits until the apiserver is ready again.

        ``down_s`` keeps it stopped that long first (clients see it gone, not just blinking).
        The log is appended to, so what the old process wrote stays.
        """
        names = [getattr(p, "name", "") for p in self._procs]
        if name not in names:
            raise ValueError(f"name: expected one of {names}, got {name!r}")
        index = names.index(name)
        old = self._procs[index]
        if old.poll() is None:
            old.send_signal(sig)
        terminate(old, timeout=10)
        time.sleep(down_s)
        assert self.workdir is not None
        self._spawn(name, list(old.args), self.workdir / "logs", index)  # type: ignore[arg-type]
        self._wait_ready(time.monotonic() + timeout)

    def _wait_ready(self, deadline: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        req = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"}
        )
        last = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{p.name} exited with {p.returncode}; see {self.log(p.name)}"
                    )  # type: ignore[attr-defined]
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except Exception as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver not ready at {self.server}/readyz: {last}")

    def log(self, name: str) -> Path:
        assert self.workdir is not None
        return self.workdir / "logs" / f"{name}.log"

    def stop(self) -> None:
        """Terminate the children in reverse start order (idempotent) and remove temp data."""
        # One at a time: an apiserver shutting down still writes to etcd (its endpoint lease).
        for p in reversed(self._procs):
            terminate(p, timeout=10)
        self._procs.clear()
        if self._owns_workdir and self.workdir is not None and not os.environ.get("KVB_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- clients ---------------------------------------------------------------------------
    def _write_kubeconfig(self, path: Path, token: str, user: str, server: str = "") -> Path:
        path.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: {server or self.server}
    certificate-authority: {self.ca_file}
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: {user}@local
  context: {{cluster: local, user: {user}}}
current-context: {user}@local
"""
        )
        path.chmod(0o600)
        return path

    @property
    def ca_file(self) -> Path:
        """The apiserver's self-signed serving certificate chain (a CA bundle for clients)."""
        assert self.workdir is not None
        return self.workdir / "pki" / "apiserver.crt"

    def kubeconfig_for_token(self, token: str, name: str, server: str = "") -> Path:
        """A kubeconfig authenticating with ``token`` (e.g. a ServiceAccount token); ``server``
        overrides the apiserver URL (e.g. a proxy in front of it; TLS is still checked)."""
        assert self.workdir is not None
        path = self.workdir / f"{name}.kubeconfig"
        return self._write_kubeconfig(path, token, user=name, server=server)

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A TokenRequest token for an existing ServiceAccount."""
        out = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={seconds}s"
        ).stdout.strip()
        return out

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; returns the completed process (text)."""
        cmd = [str(self.binaries.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        return subprocess.run(
            cmd, input=input, capture_output=True, text=True, check=check, timeout=60
        )

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """An official-client ``ApiClient`` for this cluster (admin unless told otherwise)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}


class FakeKubelet:
    """Registers Ready Nodes and moves pods through their life as a kubelet would.

    - Nodes ``nodes`` (name -> labels) are created Ready.
    - A Pending pod without ``spec.nodeName`` is bound to the first node whose labels satisfy
      its ``nodeSelector`` (round robin), then marked Running/Ready with a podIP.
    - A pod with a deletionTimestamp is deleted with grace period 0 (the kubelet's job).
    """

    def __init__(self, api_client: Any, nodes: Mapping[str, Mapping[str, str]] | None = None):
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._nodes = dict(nodes or {"node-a": {}})
        self._stop = threading.Event()
        self._rr = itertools.count()
        self._ips = (f"10.244.{i // 250}.{i % 250 + 2}" for i in itertools.count())
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._watch: Any = None

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FakeKubelet:
        for name, labels in self._nodes.items():
            self._register_node(name, labels)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=10)

    def _register_node(self, name: str, labels: Mapping[str, str]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        }
        with contextlib.suppress(ApiException):
            self._core.create_node(body)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._core.patch_node_status(
            name,
            {
                "status": {
                    "conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady",
                         "message": "fake kubelet", "lastHeartbeatTime": now,
                         "lastTransitionTime": now}
                    ],
                    "capacity": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
                    "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
                }
            },
        )  # fmt: skip

    def _loop(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                self._watch = watch.Watch()
                for ev in self._watch.stream(
                    self._core.list_pod_for_all_namespaces, timeout_seconds=60
                ):
                    if self._stop.is_set():
                        return
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._handle(ev["object"])
            except Exception:
                if self._stop.wait(0.5):
                    return

    def _handle(self, pod: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        meta, spec, status = pod.metadata, pod.spec, pod.status
        try:
            if meta.deletion_timestamp is not None:
                self._core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
                return
            if not spec.node_name:
                node = self._pick_node(spec.node_selector or {})
                if node is None:
                    return
                self._core.create_namespaced_binding(
                    meta.namespace,
                    {
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": meta.name},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                    },
                    _preload_content=False,
                )
                return
            if spec.node_name in self._nodes and (status.phase != "Running" or not status.pod_ip):
                self._mark_running(pod)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _pick_node(self, selector: Mapping[str, str]) -> str | None:
        fits = [
            n for n, labels in self._nodes.items()
            if all({"kubernetes.io/hostname": n, **labels}.get(k) == v for k, v in selector.items())
        ]  # fmt: skip
        return fits[next(self._rr) % len(fits)] if fits else None

    def _mark_running(self, pod: Any) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ]
        containers = [
            {"name": c.name, "image": c.image, "imageID": "", "ready": True, "started": True,
             "restartCount": 0, "state": {"running": {"startedAt": now}}}
            for c in pod.spec.containers
        ]  # fmt: skip
        self._core.patch_namespaced_pod_status(
            pod.metadata.name,
            pod.metadata.namespace,
            {
                "status": {
                    "phase": "Running",
                    "podIP": next(self._ips),
                    "hostIP": "127.0.0.1",
                    "startTime": now,
                    "conditions": ready,
                    "containerStatuses": containers,
                }
            },
        )


def main(argv: list[str]) -> int:
    if argv[1:2] != ["up"]:
        print(__doc__)
        return 2
    with LocalCluster() as cluster, FakeKubelet(cluster.api_client()):
        print(f"KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(f"kubectl: {cluster.binaries.kubectl}  (Ctrl-C stops the cluster)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
