"""The operator as a local ``kopf run`` process: the one launcher of the e2e and fault tests,
the chart tests, the demo's simulated stage and the benchmarks.

The operator runs the way it runs in a cluster, ``kopf run ... -m kvbridge_operator.main`` in
its own process, with whatever kubeconfig the caller gives it (a ServiceAccount token's, or
the admin's) and ``KVBRIDGE_*`` settings in its environment. ``start()`` returns once kopf's
liveness endpoint answers 200 (and, when asked, the admission webhook's port accepts), so a
caller never races the operator's start-up; an operator that exits first fails it with the
tail of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

#: ``python -m kopf run``: this interpreter, so the operator sees the caller's packages.
KOPF_RUN = (sys.executable, "-m", "kopf", "run")


class OperatorProcess:
    """``kopf run`` of kvbridge_operator in a child process; restartable.

    ``ports`` names loopback ports: ``liveness`` (required: the readiness check), and
    ``metrics`` and ``webhook`` where the operator serves them. ``args`` replaces the default
    kopf options (``--all-namespaces --liveness=... *extra_args -m kvbridge_operator.main``),
    for a caller that runs another command line, such as the chart's Deployment's.
    ``log_name`` may contain ``{start}``, the start's number (1, 2, ...), to keep every start's
    log. ``wait_webhook``: readiness also waits for ``ports["webhook"]`` to accept.
    ``stop_timeout``: seconds ``stop()`` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, kubeconfig: Path, workdir: Path, env: Mapping[str, str],
                 ports: Mapping[str, int], *, args: Sequence[str] | None = None,
                 extra_args: Sequence[str] = (), log_name: str = "operator-{start}.log",
                 wait_webhook: bool = True, stop_timeout: float = 20.0) -> None:  # fmt: skip
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.env = dict(env)
        self.ports = dict(ports)
        self.args = None if args is None else list(args)
        self.extra_args = list(extra_args)
        self.log_name = log_name
        self.wait_webhook = wait_webhook
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    @property
    def liveness_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['liveness']}/healthz"

    @property
    def log_path(self) -> Path:
        return self.workdir / self.log_name.format(start=self.starts)

    def command(self) -> list[str]:
        args = self.args
        if args is None:
            args = ["--all-namespaces", f"--liveness={self.liveness_url}", *self.extra_args,
                    "-m", "kvbridge_operator.main"]  # fmt: skip
        return [*KOPF_RUN, *args]

    def start(self, timeout: float = 60.0) -> None:
        """Start kopf and wait until it is live (and its webhook port accepts)."""
        self.starts += 1
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         env=env)  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._alive():
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for operator liveness"
                                     f"{' (and webhook)' if self._webhook else ''}")  # fmt: skip
            time.sleep(0.2)

    @property
    def _webhook(self) -> bool:
        return self.wait_webhook and "webhook" in self.ports

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log()[-4000:]}")
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=2.0) as resp:
                if resp.status != 200:
                    return False
            if self._webhook:  # served a moment after liveness
                socket.create_connection(("127.0.0.1", self.ports["webhook"]), 1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM (kopf's cleanup runs), SIGKILL after ``stop_timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the operator dies wherever it is (no cleanup handlers run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: frozen, its connections open but unread (a long GC pause, a stalled node)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def logs(self) -> str:
        """The logs of every start so far, in order (one file when ``log_name`` has no
        ``{start}``)."""
        names = dict.fromkeys(self.log_name.format(start=i) for i in range(1, self.starts + 1))
        paths = (self.workdir / n for n in names)
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())

    def metric(self, name: str) -> float:
        """Sum of all samples of a metric family line prefix (e.g. kvbridge_reconciles_total)."""
        with urllib.request.urlopen(self.metrics_url, timeout=2.0) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def loopback_settings(ports: Mapping[str, int], cert: str | Path, key: str | Path
                      ) -> dict[str, str]:  # fmt: skip
    """``KVBRIDGE_*`` settings that serve the metrics and the admission webhook (TLS with
    ``cert``/``key``, host 127.0.0.1) on ``ports``' loopback ports: nothing off this machine
    can reach a test's operator."""
    return {
        "KVBRIDGE_METRICS_PORT": str(ports["metrics"]),
        "KVBRIDGE_METRICS_ADDR": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_PORT": str(ports["webhook"]),
        "KVBRIDGE_WEBHOOK_ADDR": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_HOST": "127.0.0.1",
        "KVBRIDGE_WEBHOOK_CERT": str(cert),
        "KVBRIDGE_WEBHOOK_KEY": str(key),
    }
