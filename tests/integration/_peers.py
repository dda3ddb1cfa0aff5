"""Process harness for the NIXL data-plane tests: real separate processes over loopback.

Each :class:`Peer` is a ``multiprocessing`` *spawn* child that owns numpy memory and one or
more NIXL agents (one per engine it hosts) and obeys commands sent over a pipe. The test
process plays the other side with :class:`LocalSide`. Region memory is filled with a
per-(seed, region) byte pattern that both processes can regenerate, so the test knows
every byte the peer holds without shipping buffers around.

Every pipe wait has a deadline (:class:`PeerTimeout`). Children set ``UCX_NET_DEVICES=lo``
(and optionally ``UCX_TLS``) before NIXL is imported.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

SENTINEL = 0xA5


@dataclass(frozen=True)
class RegionSpec:
    """One KV view. ``alias_of`` makes it a view over another region's buffer."""

    name: str
    group_id: int = 0
    num_blocks: int = 8
    block_len: int = 256
    block_stride: int | None = None
    mem_type: str = "VRAM"
    is_mla: bool = True
    alias_of: str | None = None

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_len


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    regions: tuple[RegionSpec, ...]
    agent_name: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    block_size: int = 16
    ppl: int = 1
    seed: int = 1
    pattern: bool = True      # False: leave memory zeroed (big fault-test pools)

    @property
    def name(self) -> str:
        return self.agent_name or (
            self.engine_id if self.tp_rank == 0 else f"{self.engine_id}-tp{self.tp_rank}")

    @property
    def key(self) -> str:
        """How the peer process names this engine in commands (one per engine rank)."""
        return self.engine_id if self.tp_rank == 0 else f"{self.engine_id}/{self.tp_rank}"


class Memory:
    """One numpy buffer per (non-alias) region of an :class:`EngineSpec`."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.buffers: dict[str, np.ndarray] = {}
        for r in spec.regions:
            if r.alias_of is None:
                self.buffers[r.name] = np.zeros(r.num_blocks * r.stride, dtype=np.uint8)

    def buffer(self, name: str) -> np.ndarray:
        spec = next(r for r in self.spec.regions if r.name == name)
        return self.buffers[spec.alias_of or spec.name]

    def views(self) -> list[Any]:
        from kvbridge_agent.geometry import CacheView

        out = []
        for r in self.spec.regions:
            buf = self.buffer(r.name)
            out.append(CacheView.from_range(
                r.name, buf.ctypes.data, buf.nbytes, group_id=r.group_id,
                num_blocks=r.num_blocks, mem_type=r.mem_type, block_len=r.block_len,
                block_stride=r.stride, is_mla=r.is_mla))
        return out

    def fill_pattern(self, seed: int) -> None:
        for i, (_name, buf) in enumerate(sorted(self.buffers.items())):
            rng = np.random.default_rng([seed, i])
            buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)

    def fill(self, value: int) -> None:
        for buf in self.buffers.values():
            buf.fill(value)

    def snapshot(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.buffers.items()}


def expected_after(
    local: Memory,
    before: dict[str, np.ndarray],
    remote: Memory,
    copies: dict[str, list[tuple[int, int, int]]],
) -> dict[str, np.ndarray]:
    """``before`` with ``copies[region] = [(local_off, remote_off, nbytes), ...]`` applied."""
    out = {k: v.copy() for k, v in before.items()}
    for name, triples in copies.items():
        lspec = next(r for r in local.spec.regions if r.name == name)
        dst = out[lspec.alias_of or name]
        src = remote.buffer(name)
        for loff, roff, n in triples:
            dst[loff:loff + n] = src[roff:roff + n]
    return out


def block_copies(local: EngineSpec, remote: EngineSpec,
                 pairs: dict[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, int, int]]]:
    """Byte copies of whole-block pairs ``(local_block, remote_block)`` per region."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for name, plist in pairs.items():
        lr = next(r for r in local.regions if r.name == name)
        rr = next(r for r in remote.regions if r.name == name)
        out[name] = [(lb * lr.stride, rb * rr.stride, lr.block_len) for lb, rb in plist]
    return out


# --------------------------------------------------------------------------------------
# child process

@dataclass
class _Hosted:
    spec: EngineSpec
    memory: Memory
    agent: Any
    local: Any
    tracker: Any
    push: Any = None
    notifs: list[tuple[str, bytes]] = field(default_factory=list)


def _result_dict(res: Any) -> dict[str, Any]:
    from kvbridge_agent.nixl import TransferFailure

    if isinstance(res, TransferFailure):
        return {"ok": False, "cause": res.cause.value, "message": res.message,
                "error_type": type(res.error).__name__ if res.error else None}
    return {"ok": True, "nbytes": res.nbytes, "parts": res.parts, "descs": res.descs}


class _Host:
    def __init__(self) -> None:
        self.engines: dict[str, _Hosted] = {}

    def create(self, spec: EngineSpec, role: str = "producer", lease_s: float = 30.0,
               coalesce: bool = False) -> Any:
        from kvbridge_agent.nixl import (
            CPU_TEST_MEM_TYPES,
            AgentConfig,
            CompletionTracker,
            EngineFacts,
            LocalEngine,
            NixlAgent,
            PushEngine,
        )

        memory = Memory(spec)
        if spec.pattern:
            memory.fill_pattern(spec.seed)
        agent = NixlAgent(spec.name, AgentConfig(mem_types=CPU_TEST_MEM_TYPES))
        local = LocalEngine(agent, memory.views(), EngineFacts(
            spec.engine_id, tp_rank=spec.tp_rank, tp_size=spec.tp_size,
            block_size=spec.block_size, ppl=spec.ppl))
        hosted = _Hosted(spec, memory, agent, local, CompletionTracker(lease_s=lease_s))
        if role == "push":
            hosted.push = PushEngine(local, coalesce=coalesce)
        self.engines[spec.key] = hosted
        return local.describe()

    def add_peer(self, engine_id: str, desc: Any) -> str:
        h = self.engines[engine_id]
        if h.push is not None:
            return h.push.add_remote(desc)
        if desc.agent_name and h.agent.has_remote(desc.agent_name):
            h.agent.remove_remote(desc.agent_name)
        return h.agent.add_remote(desc.agent_metadata)

    def register(self, engine_id: str, request_ids: list[str], lease_s: float | None = None
                 ) -> None:
        for rid in request_ids:
            self.engines[engine_id].tracker.register(rid, lease_s=lease_s)

    def notifs(self, engine_id: str) -> dict[str, Any]:
        h = self.engines[engine_id]
        new = h.agent.get_notifs()
        for sender, msgs in new.items():
            h.notifs.extend((sender, m) for m in msgs)
        h.tracker.process(new)
        h.tracker.expire()
        return {
            "log": [(s, m.decode(errors="replace")) for s, m in h.notifs],
            "finished": sorted(h.tracker.take_finished()),
            "expired": sorted(h.tracker.take_expired()),
            "pending": list(h.tracker.pending()),
        }

    def push(self, engine_id: str, req: Any, timeout_s: float = 10.0) -> dict[str, Any]:
        h = self.engines[engine_id]
        h.push.start(req)
        return _result_dict(h.push.wait(req.request_id, timeout_s))

    def remaining_lease(self, engine_id: str, request_id: str) -> float | None:
        expiry = self.engines[engine_id].tracker.expiry(request_id)
        return None if expiry is None else expiry - time.monotonic()

    def metadata(self, engine_id: str) -> bytes:
        return self.engines[engine_id].agent.metadata()

    def close(self, engine_id: str) -> None:
        h = self.engines.pop(engine_id)
        if h.push is not None:
            h.push.close()
        h.agent.close()

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> str:
        return "pong"


def _serve(conn: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    host = _Host()
    while True:
        try:
            cmd, args, kwargs = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            for eid in list(host.engines):
                with contextlib.suppress(Exception):
                    host.close(eid)
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(host, cmd)(*args, **kwargs)))
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --------------------------------------------------------------------------------------
# parent side

class PeerError(RuntimeError):
    """The peer raised while executing a command (message includes its traceback)."""


class PeerTimeout(TimeoutError):
    """The peer did not answer before the deadline."""


class Peer:
    """A spawned peer process. ``env`` is applied before NIXL is imported there."""

    def __init__(self, env: dict[str, str] | None = None, *, start_timeout: float = 60.0
                 ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        full_env = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "ERROR", **(env or {})}
        self.proc = ctx.Process(target=_serve, args=(child, full_env), daemon=True)
        self.proc.start()
        child.close()
        self.call("ping", timeout=start_timeout)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, cmd: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        self.conn.send((cmd, args, kwargs))
        if not self.conn.poll(timeout):
            raise PeerTimeout(f"peer {self.pid}: {cmd!r} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "err":
            raise PeerError(value)
        return value

    def wait_notifs(self, engine_id: str, predicate: Any, timeout: float = 10.0
                    ) -> dict[str, Any]:
        """Poll the peer's notifications until ``predicate(state)`` or the deadline."""
        deadline = time.monotonic() + timeout
        merged: dict[str, Any] = {"finished": [], "expired": []}
        while True:
            state = self.call("notifs", engine_id)
            merged["finished"] += state["finished"]
            merged["expired"] += state["expired"]
            merged["log"] = state["log"]
            merged["pending"] = state["pending"]
            if predicate(merged):
                return merged
            if time.monotonic() > deadline:
                raise PeerTimeout(f"peer {self.pid}: notification condition not met: {merged}")
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(PeerTimeout, PeerError, OSError, EOFError):
                self.call("exit", timeout=10)
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


class LocalSide:
    """The test process's own engine: memory, NIXL agent, LocalEngine (CPU test map)."""

    def __init__(self, spec: EngineSpec, *, tls: str | None = None) -> None:
        from kvbridge_agent.nixl import (
            CPU_TEST_MEM_TYPES,
            AgentConfig,
            EngineFacts,
            LocalEngine,
            NixlAgent,
        )

        self.spec = spec
        self.memory = Memory(spec)
        self.memory.fill(SENTINEL)
        saved = os.environ.get("UCX_TLS")
        if tls is not None:
            os.environ["UCX_TLS"] = tls
        try:
            self.agent = NixlAgent(spec.name, AgentConfig(mem_types=CPU_TEST_MEM_TYPES))
        finally:
            if tls is not None:
                if saved is None:
                    os.environ.pop("UCX_TLS", None)
                else:
                    os.environ["UCX_TLS"] = saved
        self.local = LocalEngine(self.agent, self.memory.views(), EngineFacts(
            spec.engine_id, tp_rank=spec.tp_rank, tp_size=spec.tp_size,
            block_size=spec.block_size, ppl=spec.ppl))

    def describe(self) -> Any:
        return self.local.describe()

    def close(self) -> None:
        self.agent.close()


class Pair:
    """A producer engine in a :class:`Peer` process and a pull consumer engine here."""

    def __init__(self, peer: Peer, p_spec: EngineSpec, d_spec: EngineSpec, **engine_kw: Any
                 ) -> None:
        from kvbridge_agent.nixl import PullEngine

        self.peer, self.p_spec, self.d_spec = peer, p_spec, d_spec
        self.p_desc = peer.call("create", p_spec)
        self.d = LocalSide(d_spec)
        self.engine = PullEngine(self.d.local, timeout_s=10.0, **engine_kw)
        self.engine.add_remote(self.p_desc)
        peer.call("add_peer", p_spec.engine_id, self.d.describe())
        self.p_mirror = Memory(p_spec)
        self.p_mirror.fill_pattern(p_spec.seed)

    def pull(self, rid: str, local_ids: Any, remote_ids: Any, **kw: Any) -> Any:
        from kvbridge_agent.nixl import PullRequest

        self.peer.call("register", self.p_spec.engine_id, [rid])
        before = self.d.memory.snapshot()
        self.engine.start(PullRequest(rid, self.p_spec.engine_id, local_ids, remote_ids, **kw))
        return before, self.engine.wait(rid, 10.0)

    def assert_bytes(self, before: dict[str, np.ndarray],
                     copies: dict[str, list[tuple[int, int, int]]],
                     zeros: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """Local memory is ``before`` with ``copies`` applied, then ``zeros[region] =
        [(offset, nbytes), ...]`` zeroed (the pages the read did not cover)."""
        want = expected_after(self.d.memory, before, self.p_mirror, copies)
        for name, ranges in (zeros or {}).items():
            for off, n in ranges:
                want[name][off:off + n] = 0
        for name, buf in self.d.memory.buffers.items():
            np.testing.assert_array_equal(buf, want[name], err_msg=f"region buffer {name}")

    def notifs(self, rid: str) -> dict[str, Any]:
        return self.peer.wait_notifs(self.p_spec.engine_id, lambda s: rid in s["finished"])

    def close(self) -> None:
        self.engine.close()
        self.d.close()
        self.peer.call("close", self.p_spec.engine_id)
