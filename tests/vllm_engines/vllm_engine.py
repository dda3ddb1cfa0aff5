"""A real vLLM 0.30.0 engine behind a JSON-lines protocol, for kvbridge's engine-level tests.

Run by the vLLM virtualenv's python (``hack/vllm-venv.sh python``), never by the project's
venv: vLLM, CPU torch and ``nixl_cu12`` live only there. The tests drive it through
``kvbridge_testkit.vllm_harness``.

Subcommands::

    vllm_engine.py write-model DIR --kind {llama,hybrid} --seed N
    vllm_engine.py serve --model DIR --connector {none,stock,kvbridge} --kv-role ROLE \
        --engine-id ID --side-channel-port P [--load-failure-policy recompute|fail] \
        [--tp-size N]

``serve`` runs ONE in-process ``vllm.LLM`` (no engine-core subprocess; with ``--tp-size`` N > 1
vLLM spawns N worker processes) and speaks JSON lines: the first stdout line is
``{"event": "ready", ...}``, then one reply line per stdin command (``generate``,
``kv_blocks``, ``kv_info``, ``transfers``, ``connector_state``, ``preflight``, ``exit``);
the commands about the worker side run on every rank (:mod:`engine_worker`). stdout carries
protocol lines only:
file descriptor 1 is pointed at stderr before vLLM is imported, so vLLM's logging and
anything native code prints land in the engine's log.

KV layout of the CPU backend (CPU_ATTN, ``kv_cache_layout`` LBHNC), as the connector
registers it: one contiguous tensor per attention layer of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, block dimension 0. The kernel views
each (block, head) slab as ``[2 * block_size, head_dim]``: the K rows of the block's tokens,
then their V rows. Under the hybrid KV cache manager the layers at the same position of each
KV cache group share one tensor (same ``data_ptr``), indexed by that group's block ids.
``kv_blocks`` hashes ``tensor[block_id]`` (or a slice of its heads, dimension 1, which is
what one TP rank holds); ``kv_info`` reports shapes, strides and pointers, so a test can
check these assumptions.

Why each environment setting (docs/platform/vllm-on-cpu.md §3): the platform cannot be inferred on a
machine without an accelerator; no weights or usage stats can reach the network; in-process
engines keep the protocol in this process; a 1 GiB KV space and one OMP thread keep two or
three engines within a 2-core machine; TP > 1 engines bind one core per rank and run niced
(``TP_NICE``); the NIXL settings of ``worker_site/sitecustomize.py`` reach every worker process.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

import engine_worker  # beside this script: what collective_rpc runs in each worker

REPO = Path(__file__).resolve().parents[2]
SITE_DIR = Path(__file__).resolve().with_name("worker_site")

#: Niceness of a TP > 1 engine and the workers it spawns (``KVBRIDGE_TEST_TP_NICE``). While a
#: request is in flight, waiting for remote KV included, vLLM's multiprocess executor
#: spin-waits on its shared-memory queues (``sched_yield``) in the engine and in every worker,
#: and the workers are pinned one per core: on a 2-core machine that starves the other
#: engines, whose side channel and NIXL progress thread the pull needs. Measured with one more
#: spinner pinned to a core: vLLM's connector timed out its handshakes (5 s) and kvbridge's
#: READs took 18-22 s. Niced, the TP engine gets whatever CPU the others leave.
TP_NICE = "10"

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

HYBRID_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HYBRID_SLIDING_WINDOW = 64


# -- environment ----------------------------------------------------------------------------
def setup_environment(tp_size: int) -> None:
    """Agent package on sys.path, CPU settings, and the NIXL settings of ``worker_site/`` in this
    process and (through ``PYTHONPATH``) in every worker process vLLM spawns."""
    sys.path.insert(0, str(REPO / "agent"))
    os.environ.update(FORCED_ENV)
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    if tp_size > 1:
        # one core list per rank, or the CPU workers refuse to start (docs/platform/vllm-on-cpu.md)
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(cores[r % len(cores)]) for r in range(tp_size)))
        os.nice(int(os.environ.get("KVBRIDGE_TEST_TP_NICE", TP_NICE)))
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{SITE_DIR}{os.pathsep}{path}" if path else str(SITE_DIR)
    runpy.run_path(str(SITE_DIR / "sitecustomize.py"))


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
    """One in-process ``vllm.LLM`` and the command handlers of the protocol.

    Worker-side commands run on every TP rank through ``LLM.collective_rpc`` (see
    :mod:`engine_worker`); their replies keep rank 0's answer at the top level, as a TP-1
    engine gives it, and list every rank's under ``ranks``.
    """

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
        # On a CPU with AMX tiles vLLM prefers its AMX MLA backend, which packs only bf16/fp16
        # weights and refuses the float32 test model: MLA models get the reference CPU MLA
        # backend these tests are written for, whatever the machine.
        config = json.loads((Path(args.model) / "config.json").read_text())
        backend = {"attention_backend": "CPU_MLA"} if "kv_lora_rank" in config else {}
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
            tensor_parallel_size=args.tp_size,
            kv_transfer_config=kv_transfer_config,
            **backend,
        )
        if args.connector != "none":
            self._on_workers(engine_worker.install_recorder)
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

    def _on_workers(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every TP rank, results in rank order."""
        return list(self.llm.collective_rpc(fn, args=args))

    # -- commands ---------------------------------------------------------------------------
    def transfers(self, _cmd: dict[str, Any]) -> dict[str, Any]:
        """Receives that ended since the last call, on every rank (each record names its
        rank); the connector seconds are rank 0's."""
        if self.connector == "none":
            raise RuntimeError("no KV connector in this engine (started with --connector none)")
        ranks = self._on_workers(engine_worker.transfers)
        return {"ok": True, "transfers": [{**t, "rank": r["rank"]} for r in ranks
                                          for t in r["transfers"]],
                "connector_seconds": ranks[0]["connector_seconds"], "ranks": ranks}

    def connector_state(self, _cmd: dict[str, Any]) -> dict[str, Any]:
        """kvbridge only: the remote engines loaded by every rank's agent (their union),
        rank 0's epoch, and reads declined (late, other model) on all ranks."""
        ranks = self._on_workers(engine_worker.connector_state)
        return {"ok": True, "remotes": sorted({e for r in ranks for e in r["remotes"]}),
                "epoch": ranks[0]["epoch"],
                "late_reads_declined": sum(r["late_reads_declined"] for r in ranks),
                "model_mismatch_declined": sum(r["model_mismatch_declined"] for r in ranks),
                "ranks": ranks}

    def preflight(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """kvbridge only: every rank handshakes with the prefill ranks it reads from now
        (what the operator's peer assignment or ``kvbridge_peers`` trigger), so its first
        request pays none."""
        ranks = self._on_workers(engine_worker.preflight, str(cmd["engine_id"]),
                                 str(cmd["host"]), int(cmd["port"]), int(cmd.get("tp_size", 1)))
        bad = [f"rank {r['rank']}: {r['message']}" for r in ranks if not r["preflight_ok"]]
        return {"ok": True, "preflight_ok": not bad, "message": "; ".join(bad), "ranks": ranks}

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
        """Rank 0's KV tensors and groups (every rank's under ``ranks``)."""
        ranks = self._on_workers(engine_worker.kv_info, self.connector)
        return {"ok": True, **ranks[0], "ranks": ranks}

    def kv_blocks(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """sha256 per layer of the given blocks' bytes, per rank (see
        :func:`engine_worker.kv_blocks`; ``heads`` narrows each block to those KV heads)."""
        heads = cmd.get("heads")
        ranks = self._on_workers(
            engine_worker.kv_blocks, self.connector,
            [[int(b) for b in group] for group in cmd["block_ids"]], cmd.get("layers"),
            [int(h) for h in heads] if heads is not None else None)
        return {"ok": True, "sha256": ranks[0]["sha256"], "ranks": ranks}

    def dump_profile(self) -> None:
        if self.connector != "none":
            self._on_workers(engine_worker.dump_profile)


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
                engine.dump_profile()
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
    s.add_argument("--tp-size", type=int, default=1,
                   help="tensor_parallel_size: N > 1 runs N worker processes")
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
    setup_environment(args.tp_size)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
