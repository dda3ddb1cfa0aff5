"""KVBridgeConnector against vLLM 0.30.0's NixlConnector, decode side, in real vLLM engines.

Engines (tests/vllm_engines/vllm_engine.py, each its own process, vLLM CPU build, a 2-layer
random-weight Llama, 32-token blocks, max_model_len 2048): one prefill engine P1 running
KVBridgeConnector as kv_producer, and two decode engines, kv_consumer, one with
KVBridgeConnector (kvbridge's agent as its worker) and one with vLLM's stock NixlConnector.
Transfers are pulls: the decode reads the prefill's blocks over NIXL and the prefill side is
passive, so both decodes read the very same kind of source and the only difference measured
is the decode-side worker. For every rep a fresh random prompt (no prefix-cache hits
anywhere) is prefilled once per decode right before that decode's request (each decode needs
its own ``kv_transfer_params``; the prefill frees its blocks once they were read), then
decoded with ``max_tokens=1``; which decode goes first alternates rep by rep, so drift and
noise hit both alike.

- ``vllm.kv_load.tokens_L``: decode-side KV load time, from the engine step that handed the
  request to the connector to the step whose ``get_transfer_results`` reported it received
  (the ``transfers`` command's ``seconds``; failed loads are counted, not timed). It includes
  the step granularity of vLLM's busy loop, the same for both connectors.
- ``vllm.ttft.tokens_L``: wall time of the decode engine's ``generate`` call as this driver
  sees it (JSON-lines round trip, scheduling, KV load, one forward pass for one token).
- ``vllm.first_request_after_new_peer`` / ``vllm.kv_load.first_request_after_new_peer``:
  fresh prefill engines appear (new engine ids, one per sample, each stopped after its
  sample). The kvbridge decode is told about each one first (its ``preflight`` command: what
  the operator's peer assignment does), the stock decode handshakes on demand inside its
  first request; then each decode's first request from that prefill is timed (which decode
  goes first alternates). ``steady_state_*`` is the same length's median from above.
- ``vllm.new_peer.preflight``: the preflight command's driver wall time (off the request
  path), against the stock decode's first load from the new peer (its handshake is inside).

Output: JSON lines (bench/_common.py). ``value`` is kvbridge's median, ``baseline_value`` the
stock connector's median from the same run, ``ratio`` = value / baseline_value: lower is
better on every line. ``token_mismatches`` counts prompts whose two decodes disagreed (a
correctness sanity check, expected 0); ``loadavg_1m`` tells how busy the machine was. Never
asserts on timing: on a small shared machine these millisecond numbers move from run to
run, hence medians with p25/p75 and both sides interleaved within the run.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import emit
from kvbridge_testkit.vllm_harness import EngineProcess, start_engines, write_model

LENGTHS = (64, 256, 768, 1800)
REPS = int(os.environ.get("KVB_BENCH_VLLM_REPS", "24"))  # even: each decode goes first half
NEW_PEERS = 4                 # fresh prefill engines for the first-request measurement
NEW_PEER_TOKENS = 256
MAX_MODEL_LEN = 2048
BLOCK = 32
NUM_BLOCKS = 256              # a 1800-token prompt holds 57 blocks
VOCAB = 500
HOST = "127.0.0.1"
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}

PREFILL_NOTE = ("one KVBridgeConnector kv_producer engine for both decodes; pull mode, so the "
                "prefill side is passive (the decode reads its blocks)")
RATIO_IS = "value / baseline_value (kvbridge / stock NixlConnector)"


@dataclass
class Sample:
    """One decode request: driver-side wall time and the decode-side load record."""

    ttft_s: float
    load_s: float | None       # None: no load record, or the load failed
    blocks: int
    token: list[int]


def make_engine(model: Path, logs: Path, name: str, connector: str, role: str
                ) -> EngineProcess:  # fmt: skip
    engine = EngineProcess(model, logs, connector=connector, kv_role=role,
                           engine_id=f"bench-{name}", name=f"bench-{name}",
                           block_size=BLOCK, num_blocks=NUM_BLOCKS, load_failure_policy="fail",
                           max_model_len=MAX_MODEL_LEN)
    return engine


def prefill(p: EngineProcess, prompt: list[int]) -> dict[str, Any]:
    """Prefill ``prompt`` for a remote decode; the decode request's kv_transfer_params."""
    out = p.generate([prompt], 1, [{"do_remote_decode": True}])[0]
    ktp = out.get("kv_transfer_params")
    if not ktp:
        raise RuntimeError(f"{p.name}: prefill returned no kv_transfer_params: {out}")
    return {**ktp, "do_remote_prefill": True, "do_remote_decode": False}


def timed_decode(d: EngineProcess, prompt: list[int], params: dict[str, Any]) -> Sample:
    """One P/D decode request with max_tokens=1, timed by the driver, plus its load record."""
    t = time.perf_counter()
    out = d.generate([prompt], 1, [params])[0]
    ttft = time.perf_counter() - t
    records = d.call({"cmd": "transfers"})["transfers"]
    ok = len(records) == 1 and not records[0]["failed"] and out["num_cached_tokens"] > 0
    return Sample(ttft, records[0]["seconds"] if ok else None,
                  sum(len(g) for g in records[0]["local_block_ids"]) if ok else 0,
                  out["token_ids"])


def block_bytes(d: EngineProcess) -> int:
    """Bytes of one block across all KV tensors (one KV cache group: the Llama model)."""
    info = d.call({"cmd": "kv_info"})
    seen: dict[int, int] = {}
    for layer in info["layers"].values():
        shape, dtype = layer["shape"], layer["dtype"]
        seen[layer["data_ptr"]] = math.prod(shape[1:]) * ITEMSIZE[dtype]  # block dim 0
    return sum(seen.values())


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[q // 25 - 1] if len(xs) > 1 \
        else xs[0]


def ms(x: float) -> float:
    return round(x * 1e3, 3)


def spread(prefix: str, xs: list[float]) -> dict[str, float]:
    return {f"{prefix}_p25_ms": ms(pct(xs, 25)), f"{prefix}_p75_ms": ms(pct(xs, 75)),
            f"{prefix}_min_ms": ms(min(xs))}


def emit_ms(name: str, ours: list[float], base: list[float], baseline: str,
            **extra: Any) -> None:
    value, base_value = statistics.median(ours), statistics.median(base)
    emit(name, ms(value), "ms", baseline, round(value / base_value, 3),
         baseline_value=ms(base_value), **spread("kvbridge", ours), **spread("stock", base),
         lower_is_better=True, ratio_is=RATIO_IS, **extra)


def steady_state(p: EngineProcess, decodes: dict[str, EngineProcess], rng: random.Random,
                 bytes_per_block: int) -> dict[int, dict[str, list[Sample]]]:
    """Phase 1: every length, REPS fresh prompts, both decodes, alternating order."""
    by_len: dict[int, dict[str, list[Sample]]] = {}
    sides = list(decodes)
    for li, length in enumerate(LENGTHS):
        samples: dict[str, list[Sample]] = {s: [] for s in sides}
        mismatches = 0
        for rep in range(-1, REPS):   # rep -1 warms this length up, not recorded
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
            order = sides if (rep + li) % 2 == 0 else sides[::-1]
            got = {s: timed_decode(decodes[s], prompt, prefill(p, prompt)) for s in order}
            if rep >= 0:
                for s in sides:
                    samples[s].append(got[s])
                mismatches += got[sides[0]].token != got[sides[1]].token
        by_len[length] = samples
        loads = {s: [x.load_s for x in samples[s] if x.load_s is not None] for s in sides}
        failures = {s: REPS - len(loads[s]) for s in sides}
        if not all(loads.values()):
            print(f"tokens {length}: no successful loads ({failures}); skipped",
                  file=sys.stderr)
            continue
        blocks = int(statistics.median(
            x.blocks for x in samples["kvbridge"] if x.load_s is not None))
        common = {"tokens": length, "reps": REPS, "failed_loads": failures,
                  "token_mismatches": mismatches, "blocks_per_request": blocks,
                  "bytes_per_request": blocks * bytes_per_block, "prefill": PREFILL_NOTE,
                  "order": "alternating rep by rep",
                  "loadavg_1m": round(os.getloadavg()[0], 2)}
        emit_ms(f"vllm.kv_load.tokens_{length}", loads["kvbridge"], loads["stock"],
                "vLLM NixlConnector worker (decode), same engines and prompts", **common)
        emit_ms(f"vllm.ttft.tokens_{length}", [x.ttft_s for x in samples["kvbridge"]],
                [x.ttft_s for x in samples["stock"]],
                "vLLM NixlConnector decode engine's generate(max_tokens=1), same prompts",
                **common)
    return by_len


def new_peers(model: Path, logs: Path, decodes: dict[str, EngineProcess], rng: random.Random,
              steady: dict[str, list[Sample]]) -> None:
    """Phase 2: first request from freshly started prefill engines (new engine ids)."""
    peers = [make_engine(model, logs, f"p{2 + i}", "kvbridge", "kv_producer")
             for i in range(NEW_PEERS)]
    try:
        start_engines(*peers)
        preflight_s: list[float] = []
        first: dict[str, list[Sample]] = {"kvbridge": [], "stock": []}
        for i, p in enumerate(peers):
            t = time.perf_counter()
            reply = decodes["kvbridge"].call({"cmd": "preflight", "engine_id": p.engine_id,
                                              "host": HOST, "port": p.port})
            preflight_s.append(time.perf_counter() - t)
            if not reply["preflight_ok"]:
                raise RuntimeError(f"preflight of {p.engine_id} failed: {reply['message']}")
            prompt = [rng.randrange(3, VOCAB) for _ in range(NEW_PEER_TOKENS)]
            order = ["kvbridge", "stock"] if i % 2 == 0 else ["stock", "kvbridge"]
            for s in order:
                first[s].append(timed_decode(decodes[s], prompt, prefill(p, prompt)))
            p.stop()   # fewer idle engines on the CPUs for the next samples
    finally:
        for p in peers:
            p.stop()
    ok = all(x.load_s is not None for xs in first.values() for x in xs)
    if not ok:
        print(f"new peers: a first load failed: {first}", file=sys.stderr)
        return
    steady_ttft = {s: statistics.median(x.ttft_s for x in steady[s]) for s in first}
    steady_load = {s: statistics.median(
        x.load_s for x in steady[s] if x.load_s is not None) for s in first}
    ttft = {s: [x.ttft_s for x in first[s]] for s in first}
    load = {s: [x.load_s or 0.0 for x in first[s]] for s in first}
    common = {"tokens": NEW_PEER_TOKENS, "samples": NEW_PEERS,
              "loadavg_1m": round(os.getloadavg()[0], 2),
              "kvbridge_preflight_ms": [ms(x) for x in preflight_s],
              "prefill": "fresh KVBridgeConnector kv_producer engines (new engine ids), "
                         "one per sample; order of the decodes alternates",
              "lower_is_better": True, "ratio_is": RATIO_IS}
    mid = statistics.median
    emit("vllm.first_request_after_new_peer", ms(mid(ttft["kvbridge"])), "ms",
         "vLLM NixlConnector decode's first request from the new peer (handshake on demand)",
         round(mid(ttft["kvbridge"]) / mid(ttft["stock"]), 3),
         baseline_value=ms(mid(ttft["stock"])),
         kvbridge_ms=[ms(x) for x in ttft["kvbridge"]], stock_ms=[ms(x) for x in ttft["stock"]],
         kvbridge_preflighted=True,
         kvbridge_plus_preflight_ms=ms(mid(map(sum, zip(ttft["kvbridge"], preflight_s,
                                                        strict=True)))),
         steady_state_kvbridge_ms=ms(steady_ttft["kvbridge"]),
         steady_state_stock_ms=ms(steady_ttft["stock"]), **common)
    emit("vllm.kv_load.first_request_after_new_peer", ms(mid(load["kvbridge"])), "ms",
         "vLLM NixlConnector decode's first load from the new peer (handshake inside it)",
         round(mid(load["kvbridge"]) / mid(load["stock"]), 3),
         baseline_value=ms(mid(load["stock"])),
         kvbridge_ms=[ms(x) for x in load["kvbridge"]], stock_ms=[ms(x) for x in load["stock"]],
         steady_state_kvbridge_ms=ms(steady_load["kvbridge"]),
         steady_state_stock_ms=ms(steady_load["stock"]), **common)
    emit("vllm.new_peer.preflight", ms(mid(preflight_s)), "ms",
         "vLLM NixlConnector decode's first load from the new peer (its handshake is inside "
         "it; kvbridge's preflight runs before any request, off the request path)",
         round(mid(preflight_s) / mid(load["stock"]), 3),
         baseline_value=ms(mid(load["stock"])),
         stock_handshake_estimate_ms=ms(mid(load["stock"]) - steady_load["stock"]),
         **common)


def main() -> None:
    started = time.perf_counter()
    rng = random.Random(int(os.environ.get("KVB_BENCH_SEED", "20300")))
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-vllm-"))
    model = write_model(work / "model", kind="llama", seed=11)
    logs = work / "logs"
    p1 = make_engine(model, logs, "p1", "kvbridge", "kv_producer")
    decodes = {"kvbridge": make_engine(model, logs, "d-kvb", "kvbridge", "kv_consumer"),
               "stock": make_engine(model, logs, "d-stock", "stock", "kv_consumer")}
    engines = [p1, *decodes.values()]
    done = False
    try:
        start_engines(*engines)
        print(f"engines ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        sizes = {s: block_bytes(d) for s, d in decodes.items()}
        if sizes["kvbridge"] != sizes["stock"]:
            print(f"block bytes differ between the decodes: {sizes}", file=sys.stderr)
        by_len = steady_state(p1, decodes, rng, sizes["kvbridge"])
        new_peers(model, logs, decodes, rng, by_len.get(NEW_PEER_TOKENS) or by_len[LENGTHS[0]])
        done = True
    finally:
        for e in engines:
            e.stop()
        if done:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"engine logs kept in {logs}", file=sys.stderr)
    print(f"bench_vllm: {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
