"""vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) as
a child process, with KVBridgeConnector from the one flag: the engines users deploy, on
127.0.0.1, for the router's tests and benchmark.

The server runs under the vLLM venv (``hack/vllm-venv.sh``) with this checkout's agent first
on its path, so it runs the code under test, not the venv's installed copy. Its log goes to
a file; errors raised here carry its tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbridge_testkit.procs import free_port
from kvbridge_testkit.vllm_harness import REPO, START_TIMEOUT_S, EngineError, vllm_python
from kvbridge_testkit.vllm_pods import MODEL

#: The CPU settings of docs/platform/vllm-on-cpu.md: the platform stated, one OMP thread per
#: engine (several share 2 cores), a small KV space, UCX on loopback.
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "ERROR",
}  # fmt: skip


def connector_config(engine_id: str | None = None, **extra: Any) -> str:
    """The ``--kv-transfer-config`` of a kvbridge engine (``kv_both``: it prefills for
    decodes and decodes from prefills); ``extra`` goes to ``kv_connector_extra_config``."""
    config: dict[str, Any] = {"kv_connector": "KVBridgeConnector",
                              "kv_connector_module_path": "kvbridge_agent.vllm",
                              "kv_role": "kv_both", "kv_buffer_device": "cpu"}  # fmt: skip
    if engine_id:
        config["engine_id"] = engine_id
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


class OpenAIServer:
    """One ``vllm serve`` process: start, wait until ``/health`` answers, stop or kill.
    ``host``: the address it serves and advertises, one of its own on the loopback
    (127.0.0.x) where a test needs engines told apart by address, as pods are.
    ``extra_args``: more ``vllm serve`` arguments, after the others."""

    def __init__(self, model: Path, log_dir: Path, name: str, *, env: dict[str, str] | None = None,
                 dtype: str = "float32", num_blocks: int = 256, max_num_seqs: int | None = None,
                 connector: str | None = None, host: str = "127.0.0.1",
                 max_model_len: int = 1024, extra_args: Sequence[str] = ()) -> None:  # fmt: skip
        self.name = name
        self.host = host
        self.port = free_port()
        self.side_port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self.argv = [
            vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL, "--host", host, "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--block-size", "32",
            "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
            "--kv-transfer-config", connector or connector_config(),
        ]  # fmt: skip
        if max_num_seqs is not None:
            self.argv += ["--max-num-seqs", str(max_num_seqs)]
        self.argv += list(extra_args)
        base = {k: v for k, v in os.environ.items()
                if k not in ("POD_NAME", "POD_UID", "KUBECONFIG")}  # fmt: skip
        self.env = {**base, **CPU_ENV, "PYTHONPATH": str(REPO / "agent"),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
                    "KVBRIDGE_SERVING_PORT": str(self.port), **(env or {})}  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OpenAIServer:
        with self.log_path.open("wb") as log:
            # Not in a session of its own: with start_new_session the engines' first KV pulls
            # stalled for minutes in 5 of 5 runs here (none without it); kill() walks /proc.
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> OpenAIServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise self._error("exited before it served")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise self._error(f"not serving within {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL to the server and every process it started (vLLM's engine core and its
        worker), as a node losing the pod."""
        if self.proc is None:
            return
        for pid in (self.proc.pid, *descendants(self.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        children = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        for pid in children:   # whatever of them outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _error(self, message: str) -> EngineError:
        return EngineError(f"vllm serve {self.name}: {message}; log {self.log_path}:\n"
                           f"{self.log_tail()}")  # fmt: skip


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(parents.get(child, []))
    return out


def start_servers(*servers: OpenAIServer, timeout: float = START_TIMEOUT_S) -> None:
    """Start ``servers`` together and wait for all (they share the cores while loading)."""
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready(timeout)
