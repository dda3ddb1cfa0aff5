"""A real vLLM 0.30.0 engine behind a JSON-lines protocol, for kvbridge's engine-level tests.

Run by the vLLM virtualenv's python (``hack/vllm-venv.sh python``), never by the project's
venv: vLLM, CPU torch and ``nixl_cu12`` live only there. The tests drive it through
``tests/vllm_engines/vllm_harness.py``.

Subcommands::

    vllm_engine.py write-model DIR --kind {llama,hybrid} --seed N
    vllm_engine.py serve --model DIR --connector {none,stock,kvbridge} --kv-role ROLE \
        --engine-id ID --side-channel-port P [--load-failure-policy recompute|fail]

``serve`` runs ONE in-process ``vllm.LLM`` (no engine-core subprocess) and speaks JSON lines:
the first stdout line is ``{"event": "ready", ...}``, then one reply line per stdin command
(``generate``, ``kv_blocks``, ``kv_info``, ``exit``). stdout carries protocol lines only:
file descriptor 1 is pointed at stderr before vLLM is imported, so vLLM's logging and
anything native code prints land in the engine's log.

KV layout of the CPU backend (CPU_ATTN, ``kv_cache_layout`` LBHNC), as the connector
registers it: one contiguous tensor per attention layer of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, block dimension 0. The kernel views
each (block, head) slab as ``[2 * block_size, head_dim]``: the K rows of the block's tokens,
then their V rows. Under the hybrid KV cache manager the layers at the same position of each
KV cache group share one tensor (same ``data_ptr``), indexed by that group's block ids.
``kv_blocks`` hashes ``tensor[block_id]``; ``kv_info`` reports shapes, strides and pointers,
so a test can check these assumptions.

Why each environment setting (notes/vllm-on-cpu.md §3): the platform cannot be inferred on a
machine without an accelerator; no weights or usage stats can reach the network; in-process
engines keep the protocol and ``get_kv_transfer_group()`` in this process; a 1 GiB KV space
and one OMP thread keep two or three engines within a 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]

#: Set before vLLM (and NIXL/UCX) are imported; callers may override the setdefault ones.
FORCED_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "ERROR",
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
}

#: Progress-thread poll interval for every NIXL agent in this process (µs). The wrapper
#: hard-codes 0, which busy-spins a core per agent and starves the other engine's handshake.
NIXL_PROGRESS_DELAY_US = 100

NIXL_ALIASES = ("", "._api", "._bindings", "._utils", ".logging")

HYBRID_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HYBRID_SLIDING_WINDOW = 64


# -- environment ----------------------------------------------------------------------------
def setup_environment() -> None:
    """Agent package on sys.path, CPU settings, ``nixl`` aliased to ``nixl_cu12``."""
    sys.path.insert(0, str(REPO / "agent"))
    os.environ.update(FORCED_ENV)
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    alias_nixl()
    patch_nixl_progress_delay(NIXL_PROGRESS_DELAY_US)


def alias_nixl() -> None:
    """Make ``import nixl._api`` resolve to ``nixl_cu12``.

    vLLM imports NIXL as ``nixl._api``; the ``nixl`` meta package would pick ``nixl-cu13``
    from the CUDA version torch's dependencies report and fail, so it is not installed.
    """
    for suffix in NIXL_ALIASES:
        sys.modules.setdefault(f"nixl{suffix}", importlib.import_module(f"nixl_cu12{suffix}"))


def patch_nixl_progress_delay(delay_us: int) -> None:
    """Give every NIXL agent created in this process a sleeping progress thread.

    ``nixl_agent.__init__`` (nixl_cu12 1.5.1 ``_api.py``) builds a ``nixlAgentConfig`` with
    ``pthrDelay = 0`` and hands it to ``_bindings.nixlAgent``; it is the only caller of that
    constructor, so wrapping it reaches the stock connector's agent and any other one. A
    non-zero delay chosen by the caller (kvbridge's own agents patch it to their configured
    value) is kept.
    """
    bindings = importlib.import_module("nixl_cu12._bindings")
    original = bindings.nixlAgent
    if getattr(original, "_kvb_delay_patched", False):
        return

    def _agent(agent_name: str, agent_config: Any) -> Any:
        if agent_config.pthrDelay == 0:
            agent_config.pthrDelay = delay_us
        return original(agent_name, agent_config)

    _agent._kvb_delay_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = _agent


def protocol_stdout() -> TextIO:
    """Keep the real stdout for protocol lines; point fd 1 (and ``sys.stdout``) at stderr."""
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


# -- model writer ---------------------------------------------------------------------------
def model_config(kind: str) -> dict[str, Any]:
    """The project's tiny Llama (``kvbridge write-test-model``); ``hybrid`` interleaves
    sliding-window and full-attention layers, which the hybrid KV cache manager splits into
    two KV cache groups."""
    from kvbridge_agent._testmodel import CONFIG

    config = dict(CONFIG)
    if kind == "hybrid":
        config["num_hidden_layers"] = len(HYBRID_LAYER_TYPES)
        config["layer_types"] = list(HYBRID_LAYER_TYPES)
        config["sliding_window"] = HYBRID_SLIDING_WINDOW
    elif kind != "llama":
        raise ValueError(f"--kind: expected llama or hybrid, got {kind!r}")
    return config


#: A DeepSeek-V2-style MLA model, as small as vLLM's CPU MLA kernel allows: its latent cache
#: must be kv_lora_rank 512 + rope 64 = 576 wide (cpu_mla.py), and it runs block size 16.
MLA_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "first_k_dense_replace": 2, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu",
}


def write_mla_model(out: Path, seed: int, std: float) -> dict[str, Any]:
    """The MLA model through transformers' own DeepseekV2 class (its parameter names are the
    checkpoint names vLLM loads), every weight re-drawn from a seeded generator."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(DeepseekV2Config(**MLA_CONFIG))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(str(out), safe_serialization=True)
    return dict(MLA_CONFIG)


def write_model(out: Path, kind: str, seed: int, std: float = 0.08) -> dict[str, Any]:
    """Write config.json and seeded random float32 weights (and the project's tokenizer).

    Random weights, not vLLM's dummy loader: with dummy weights the greedy tokens depend only
    on the last prompt token, so a transfer that delivered wrong KV would still "match".
    """
    if kind == "mla":
        return write_mla_model(out, seed, std)
    from kvbridge_agent import _testmodel

    config = model_config(kind)
    _testmodel.write_test_model(out, seed=seed, config=config)
    return config


# -- engine ---------------------------------------------------------------------------------
CONNECTORS: dict[str, dict[str, Any]] = {
    "stock": {"kv_connector": "NixlConnector"},
    "kvbridge": {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge_agent.vllm",
    },
    "kvbridge-push": {
        "kv_connector": "KVBridgePushConnector",
        "kv_connector_module_path": "kvbridge_agent.vllm",
    },
}


class Engine:
    """One in-process ``vllm.LLM`` and the command handlers of the protocol."""

    def __init__(self, args: argparse.Namespace) -> None:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.side_channel_port)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kv_transfer_config = None
        if args.connector != "none":
            kv_transfer_config = KVTransferConfig(
                **CONNECTORS[args.connector],
                kv_role=args.kv_role,
                engine_id=args.engine_id,
                kv_buffer_device="cpu",
                kv_load_failure_policy=args.load_failure_policy,
                kv_connector_extra_config=json.loads(args.extra_config),
            )
        self.connector = args.connector
        self.llm = LLM(
            model=str(args.model),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            block_size=args.block_size,
            num_gpu_blocks_override=args.num_blocks,
            max_model_len=args.max_model_len,
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=kv_transfer_config,
        )
        self.recorder = TransferRecorder(self._worker_connector()) \
            if args.connector != "none" else None
        self._configure_logging()

    @staticmethod
    def _configure_logging() -> None:
        """kvbridge's INFO lines (handshakes, dropped peers) into the engine log."""
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("KVB %(levelname)s %(name)s: %(message)s"))
        kvb = logging.getLogger("kvbridge")
        kvb.addHandler(handler)
        kvb.setLevel(logging.INFO)

    # -- commands ---------------------------------------------------------------------------
    def transfers(self, _cmd: dict[str, Any]) -> dict[str, Any]:
        """Receives that ended since the last call (see :class:`TransferRecorder`)."""
        if self.recorder is None:
            raise RuntimeError("no KV connector in this engine (started with --connector none)")
        return {"ok": True, "transfers": self.recorder.take(),
                "connector_seconds": {k: {"seconds": v[0], "calls": v[1], "cpu_seconds": v[2]}
                                      for k, v in self.recorder.spent.items()}}

    def connector_state(self, _cmd: dict[str, Any]) -> dict[str, Any]:
        """kvbridge only: the remote engines its agent has loaded (preflighted or not)."""
        worker = self._worker_connector().connector_worker
        service = getattr(worker, "service", None)
        if service is None:
            raise RuntimeError(f"{type(worker).__name__} is not kvbridge's worker")
        from kvbridge_agent import metrics

        return {"ok": True, "remotes": sorted({p.engine_id for p in service.peers().values()}),
                "epoch": service.epoch,
                "late_reads_declined": metrics.value("kvbridge_agent_late_reads_declined_total")}

    def preflight(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """kvbridge only: handshake with a prefill engine now (what the operator's peer
        assignment or ``kvbridge_peers`` trigger), so its first request pays none."""
        worker = self._worker_connector().connector_worker
        ok, message = worker.preflight(cmd["engine_id"], cmd["host"], int(cmd["port"]),
                                       int(cmd.get("tp_size", 1)))
        return {"ok": True, "preflight_ok": ok, "message": message}

    def generate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = cmd["prompts"]
        params = cmd.get("kv_transfer_params") or [None] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"kv_transfer_params: expected {len(prompts)} entries (one per prompt), "
                f"got {len(params)}"
            )
        sampling = [
            SamplingParams(
                temperature=0.0,
                ignore_eos=True,
                max_tokens=int(cmd.get("max_tokens", 8)),
                extra_args={"kv_transfer_params": p} if p is not None else None,
            )
            for p in params
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts],
            sampling,
            use_tqdm=False,
        )
        return {
            "ok": True,
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                    "num_cached_tokens": int(o.num_cached_tokens or 0),
                    "finish_reason": o.outputs[0].finish_reason,
                }
                for o in outs
            ],
        }

    def kv_info(self, _cmd: dict[str, Any]) -> dict[str, Any]:
        caches = self._kv_caches()
        return {
            "ok": True,
            "connector_class": type(self._worker_connector()).__name__
            if self.connector != "none" else None,
            "layers": {
                name: {
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "data_ptr": t.data_ptr(),
                }
                for name, t in caches.items()
            },
            "groups": [
                {"layer_names": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                 "block_size": g.kv_cache_spec.block_size,
                 "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
                for g in self._kv_cache_config().kv_cache_groups
            ],
            "num_blocks": self._kv_cache_config().num_blocks,
        }

    def kv_blocks(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """sha256 per layer of the given blocks' bytes (block dimension 0, see module doc).

        Whole blocks: a partial last block also holds whatever the engine wrote after the
        prompt (decode tokens, stale rows), so only full prompt blocks compare across engines.
        """
        import torch

        block_ids: list[list[int]] = cmd["block_ids"]
        caches = self._kv_caches()
        wanted = cmd.get("layers") or list(caches)
        group_of = {
            name: gi
            for gi, g in enumerate(self._kv_cache_config().kv_cache_groups)
            for name in g.layer_names
        }
        digests: dict[str, str] = {}
        for name in wanted:
            if name not in caches:
                raise KeyError(f"layers: unknown layer {name!r}; known: {sorted(caches)}")
            gi = group_of.get(name, 0)
            if gi >= len(block_ids):
                raise ValueError(
                    f"block_ids: layer {name!r} is in group {gi}, got ids for "
                    f"{len(block_ids)} group(s)"
                )
            h = hashlib.sha256()
            tensor = caches[name]
            for b in block_ids[gi]:
                h.update(tensor[int(b)].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            digests[name] = h.hexdigest()
        return {"ok": True, "sha256": digests}

    # -- introspection ----------------------------------------------------------------------
    def _worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise RuntimeError("no KV connector in this engine (started with --connector none)")
        return get_kv_transfer_group()

    def _kv_caches(self) -> dict[str, Any]:
        """The KV tensors as the worker connector registered them, else the runner's."""
        if self.connector == "none":
            return dict(self._model_runner().kv_caches_by_name())
        conn = self._worker_connector()
        worker = getattr(conn, "connector_worker", None)
        for owner, attr in ((worker, "device_kv_caches"), (worker, "kv_caches"),
                            (conn, "kv_caches")):
            caches = getattr(owner, attr, None) if owner is not None else None
            if caches:
                return dict(caches)
        raise RuntimeError(
            f"{type(conn).__name__}: no registered KV caches found (looked for "
            "connector_worker.device_kv_caches, connector_worker.kv_caches, kv_caches)"
        )

    def _engine_core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    def _model_runner(self) -> Any:
        runner = self._engine_core().model_executor.driver_worker.worker.model_runner
        return _RunnerCaches(runner)

    def _kv_cache_config(self) -> Any:
        return self._engine_core().scheduler.kv_cache_config


class TransferRecorder:
    """Instrumentation of the worker-side connector (stock or kvbridge alike): for every
    request it receives, the block ids on both sides, when the engine step that first handed
    it to the connector began, and when the connector reported it received (or failed).

    Wraps the two facade methods vLLM's model runner calls every step; the connector's own
    code runs unchanged inside them.
    """

    def __init__(self, connector: Any) -> None:
        import time

        self._now = time.perf_counter
        self._open: dict[str, dict[str, Any]] = {}
        self._done: list[dict[str, Any]] = []
        #: per method: wall seconds inside the connector, calls, and the engine thread's CPU
        #: seconds there (thread_time: not inflated when the machine preempts the engine)
        self.spent: dict[str, list[float]] = {"start_load_kv": [0.0, 0, 0.0],
                                              "get_transfer_results": [0.0, 0, 0.0]}
        start_load, results = connector.start_load_kv, connector.get_transfer_results
        #: ``KVB_PROFILE_CONNECTOR=FILE``: cProfile the connector calls, stats dumped at exit
        self.profile_path = os.environ.get("KVB_PROFILE_CONNECTOR")
        self.profile: Any = None
        if self.profile_path:
            import cProfile

            self.profile = cProfile.Profile()

        def start_load_kv(forward_context: Any, **kwargs: Any) -> Any:
            meta = getattr(connector, "_connector_metadata", None)
            new = [r for r in getattr(meta, "reqs_to_recv", {}) if r not in self._open]
            for req_id, req in getattr(meta, "reqs_to_recv", {}).items():
                if req_id not in self._open and req.remote is not None:
                    self._open[req_id] = {
                        "request_id": req_id, "t_start": self._now(),
                        "step_start": self.spent["get_transfer_results"][1],
                        "local_block_ids": [list(map(int, g)) for g in req.local_block_ids],
                        "remote_block_ids": [list(map(int, g)) for g in req.remote.block_ids],
                        "remote_engine_id": req.remote.engine_id}
            t0, c0 = self._now(), time.thread_time()
            if self.profile is not None:
                self.profile.enable()
            try:
                return start_load(forward_context, **kwargs)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                self._spend("start_load_kv", t0, c0)
                for req_id in new:   # the connector CPU of the step that started the load
                    if req_id in self._open:
                        self._open[req_id]["start_cpu_us"] = (time.thread_time() - c0) * 1e6
                        self._open[req_id]["start_wall_us"] = (self._now() - t0) * 1e6

        def get_transfer_results(finished_req_ids: Any) -> Any:
            t0, c0 = self._now(), time.thread_time()
            if self.profile is not None:
                self.profile.enable()
            out = results(finished_req_ids)
            if self.profile is not None:
                self.profile.disable()
            self._spend("get_transfer_results", t0, c0)
            done_cpu_us = (time.thread_time() - c0) * 1e6
            now = self._now()
            done_wall_us = (now - t0) * 1e6
            for req_id in out.finished_recving:
                rec = self._open.pop(req_id, None)
                if rec is not None:
                    rec["seconds"] = now - rec.pop("t_start")
                    # engine steps (get_transfer_results calls) the load took, this one included
                    rec["steps"] = self.spent["get_transfer_results"][1] - rec.pop("step_start")
                    rec["done_cpu_us"] = done_cpu_us
                    rec["done_wall_us"] = done_wall_us
                    rec["failed"] = req_id in out.failed_recving
                    self._done.append(rec)
            return out

        connector.start_load_kv = start_load_kv
        connector.get_transfer_results = get_transfer_results

    def _spend(self, method: str, since: float, cpu_since: float) -> None:
        import time

        acc = self.spent[method]
        acc[0] += self._now() - since
        acc[1] += 1
        acc[2] += time.thread_time() - cpu_since

    def take(self) -> list[dict[str, Any]]:
        out, self._done = self._done, []
        return out

    def dump_profile(self) -> None:
        if self.profile is not None and self.profile_path:
            self.profile.dump_stats(self.profile_path)


class _RunnerCaches:
    """Layer name -> KV tensor from the model runner, for engines without a connector."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def kv_caches_by_name(self) -> dict[str, Any]:
        ctx = self.runner.vllm_config.compilation_config.static_forward_context
        return {name: layer.kv_cache for name, layer in ctx.items()
                if hasattr(layer, "kv_cache") and hasattr(layer.kv_cache, "shape")}


def serve(args: argparse.Namespace) -> int:
    """Start the engine, announce it, answer one JSON command per stdin line."""
    proto = protocol_stdout()
    engine = Engine(args)
    handlers = {"generate": engine.generate, "kv_info": engine.kv_info,
                "kv_blocks": engine.kv_blocks, "transfers": engine.transfers,
                "connector_state": engine.connector_state, "preflight": engine.preflight}
    _reply(proto, {"event": "ready", "engine_id": args.engine_id,
                   "port": args.side_channel_port, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            name = cmd.get("cmd")
            if name == "exit":
                if engine.recorder is not None:
                    engine.recorder.dump_profile()
                _reply(proto, {"ok": True})
                break
            if name not in handlers:
                raise ValueError(f"cmd: expected one of {sorted([*handlers, 'exit'])}, "
                                 f"got {name!r}")
            reply = handlers[name](cmd)
        except Exception as exc:  # keep serving: the test reads the error
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _reply(proto, reply)
    proto.flush()
    # vLLM's NIXL threads and atexit hooks can hang an orderly shutdown; the test is done.
    sys.stderr.flush()
    os._exit(0)


def _reply(proto: TextIO, obj: dict[str, Any]) -> None:
    proto.write(json.dumps(obj, default=_jsonable) + "\n")
    proto.flush()


def _jsonable(value: Any) -> Any:
    """kv_transfer_params may hold tuples, bytes or numpy scalars."""
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-model", help="write a tiny random-weight model directory")
    w.add_argument("dir", type=Path)
    w.add_argument("--kind", choices=["llama", "hybrid", "mla"], default="llama")
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("serve", help="run one engine behind the JSON-lines protocol")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--connector", choices=["none", *CONNECTORS], default="none")
    s.add_argument("--kv-role", choices=["kv_producer", "kv_consumer", "kv_both"],
                   default="kv_both")
    s.add_argument("--engine-id", required=True)
    s.add_argument("--side-channel-port", type=int, required=True)
    s.add_argument("--load-failure-policy", choices=["recompute", "fail"], default="fail")
    s.add_argument("--block-size", type=int, default=32)
    s.add_argument("--num-blocks", type=int, default=128)
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument("--extra-config", default="{}",
                   help="JSON object for kv_connector_extra_config")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "write-model":
        sys.path.insert(0, str(REPO / "agent"))   # the checkout's writer, not the venv's copy
        config = write_model(args.dir, args.kind, args.seed)
        print(json.dumps({"ok": True, "dir": str(args.dir), "layers": config["num_hidden_layers"]}))
        return 0
    setup_environment()
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
