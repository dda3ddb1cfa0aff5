"""A real, local Kubernetes v1.20.2 control plane for tests, chart checks and the demo.

``LocalCluster`` starts etcd, kube-apiserver and kube-controller-manager (garbage collector,
namespace, service-account and workload controllers) as child processes on free loopback
ports, with a temporary data directory, an admin token, RBAC authorization and service-account
signing keys, and writes an admin kubeconfig. ``FakeKubelet``
(:mod:`~kvbridge_testkit.fake_kubelet`) plays the node: it registers Ready Nodes, binds Pending
pods, marks them Running/Ready with a podIP and finishes pod deletion. With
``real_nodes=True`` it also runs kube-scheduler and serves real kubelets
(:mod:`kvbridge_testkit.node`): ServiceAccount admission with pod-bound tokens, the
``kubernetes`` Service's endpoints, and the endpoint, root-CA and node-lifecycle controllers.
Binaries come from ``hack/test-stack.sh ensure`` (:mod:`~kvbridge_testkit.stack`). Every wait
has a deadline.

``FakeKubelet``, the stack's names and the process helpers (:mod:`~kvbridge_testkit.procs`)
stay importable from here.

CLI (for a demo or by hand)::

    python -m kvbridge_testkit.cluster up      # prints KUBECONFIG=..., Ctrl-C tears down
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge_testkit.fake_kubelet import FakeKubelet
from kvbridge_testkit.procs import free_port, terminate
from kvbridge_testkit.stack import (
    CACHE,
    ENSURE_HINT,
    KUBE_VERSION,
    Binaries,
    StackMissingError,
)

__all__ = [
    "CACHE", "ENSURE_HINT", "KUBE_VERSION", "Binaries", "FakeKubelet", "LocalCluster",
    "StackMissingError", "free_port", "terminate",
]  # fmt: skip


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
