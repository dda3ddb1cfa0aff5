"""The router's pair-choice policies, ``least-load`` against ``cache-aware``, on real vLLM
engines serving prompts that share long prefixes, and on a control whose prompts share none.

Engines: two prefills and two decodes, each a ``vllm serve`` process (the vLLM venv of
hack/vllm-venv.sh, vLLM 0.30.0's CPU build, KVBridgeConnector, one OMP thread each on this
machine's cores) with prefix caching on (``--enable-prefix-caching``, V1's default, stated)
and KV events on (``--kv-events-config``, ZMQ publisher). Every engine has a loopback address
of its own (127.0.0.21 to .24, as a pod has an IP) and publishes on the same port there, as
pods would: the router follows ``tcp://<engine host>:<port>`` for each. (vLLM's publisher binds
only an endpoint with ``*`` or ``::`` in it and connects to any other, so each engine is given
``tcp://[::ffff:127.0.0.2x]:PORT``: ZMQ binds that IPv4-mapped form on the IPv4 address
alone, where ``tcp://*:PORT``, a pod's setting, would clash on one machine.)

The model: ``write_test_model`` with a larger config than the tests' (``MODEL_CONFIG``: hidden
512, intermediate 1,536, 6 layers, 8 query / 4 KV heads of 64), float32, blocks of 32 tokens,
so a block's KV is 2 x 6 x 4 x 64 x 32 x 4 B = 384 KiB (12 KiB a token), and prefilling a
1,536-token prefix costs several times what a request whose prefix is cached costs: both are
measured at the start and printed (``prefix.cold_vs_warm_ttft``).

The router runs in a process of its own with a fixed routing table (every decode paired with
both prefills over ``cma``; no control plane), restarted before every run so that its prefix
index starts empty, and every engine's prefix cache is reset (``POST /reset_prefix_cache``,
``VLLM_SERVER_DEV_MODE=1``) before every run: each run starts cold. cache-aware runs with
precise tracking (the KV events, prompts tokenized by the engines' ``/tokenize``),
``balance_factor`` 1.5, and weights measured here before the runs, on one idle pair:
``prefill_ms_per_block`` (a cold prefill call minus a cached one, over the prompt's blocks),
``queue_ms`` (the TTFT of a request whose prefix both engines hold: what one more request
already at an engine costs a new one, at least) and the transport's throughput (a decode that
must pull the whole prompt against one that holds it).

Workloads (sizes also in every line's extras):

- ``shared``: 16 tenants, each with its own system prompt of random words tokenizing to 1,536
  tokens (48 blocks; measured with ``/tokenize``), and a question of 32 to 128 tokens
  (random words, fresh per request). ``KVB_BENCH_PREFIX_REQUESTS`` (default 200) requests at
  concurrency ``KVB_BENCH_PREFIX_CONCURRENCY`` (default 8), tenants in a seeded random order.
  Each engine's KV pool (``--num-gpu-blocks-override`` 448 blocks = 14,336 tokens) holds about
  half of the tenants' prefixes (16 x 48 = 768 blocks; half is 384) plus room for requests in
  flight.
- ``control``: the same counts, every prompt unique (a fresh ~1,536-token text and a question).

Requests: completions, ``max_tokens`` 8, greedy, ``ignore_eos``, streaming; TTFT is measured at
the client, from sending the request to the first ``data:`` event of the answer. Each policy
runs once per round from cold caches, in alternating order over two rounds (round 1:
least-load then cache-aware; round 2: cache-aware then least-load), both policies given the
same requests within a round. Measured per run from the engines' ``/metrics`` (deltas of
``vllm:prompt_tokens_by_source``): KV pulled (a decode's ``external_kv_transfer`` tokens x 12
KiB) and prefill tokens computed (the prefills' ``local_compute``); from the router's
``/metrics``: requests per pair (load spread: requests an engine served over its role's mean,
the largest over the four engines).

Lines (value: cache-aware, merged over both rounds; ``ratio`` = cache-aware / least-load;
lower is better for all): ``prefix.ttft_p50.W``, ``prefix.ttft_p90.W``,
``prefix.kv_bytes_per_request.W``, ``prefix.prefill_tokens_per_request.W``,
``prefix.load_spread.W`` for W in shared, control. Targets (printed, never asserted): shared
p50 TTFT at most 0.6x, KV bytes pulled at most 0.4x, no engine above 1.5x its role's mean
load; the control never worse than 1.05x.

Never asserts on timing. ``loadavg_1m`` says how busy the machine was. Run:
``.venv/bin/python bench/bench_prefix.py``: about 22 minutes on 2 cores with the defaults (the
control's all-cold runs take most of it), about 12 with ``KVB_BENCH_PREFIX_REQUESTS=100``. One
line per run goes to stderr; the engines' and the router's logs (each cache-aware decision at
DEBUG) stay in the folder printed at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from _common import emit
from kvbridge_agent._testmodel import CONFIG, write_test_model
from kvbridge_router.balance import ChooserSettings
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.vllm_servers import OpenAIServer, connector_config, start_servers

REQUESTS = int(os.environ.get("KVB_BENCH_PREFIX_REQUESTS", "200"))
CONCURRENCY = int(os.environ.get("KVB_BENCH_PREFIX_CONCURRENCY", "8"))
TENANTS = 16
SYSTEM_TOKENS = 1536
QUESTION_TOKENS = (32, 128)
MAX_TOKENS = 8
BLOCK = 32
NUM_BLOCKS = 448
MAX_MODEL_LEN = 2048
BALANCE_FACTOR = 1.5
POLICIES = ("least-load", "cache-aware")
WORKLOADS = ("shared", "control")
MODEL_CONFIG: dict[str, Any] = {
    **CONFIG, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
}  # fmt: skip
#: one block's KV over all layers: K and V, float32
BLOCK_BYTES = (2 * MODEL_CONFIG["num_hidden_layers"] * MODEL_CONFIG["num_key_value_heads"]
               * MODEL_CONFIG["head_dim"] * BLOCK * 4)  # fmt: skip
TOKEN_BYTES = BLOCK_BYTES // BLOCK
#: name: (role, loopback address)
ENGINES = {"p0": ("prefill", "127.0.0.21"), "p1": ("prefill", "127.0.0.22"),
           "d0": ("decode", "127.0.0.23"), "d1": ("decode", "127.0.0.24")}  # fmt: skip
#: the issue's targets, printed with the lines (never asserted)
TARGETS = {"shared": {"ttft_p50": "ratio <= 0.6", "kv_bytes_per_request": "ratio <= 0.4",
                      "load_spread": "value <= 1.5"},
           "control": "ratio <= 1.05"}  # fmt: skip

ROUTER = """
import json, logging, sys
from aiohttp import web
from kvbridge_router.affinity import TrackingSettings
from kvbridge_router.balance import ChooserSettings
from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.table import Engine, RoutingTable
conf = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("kvbridge.router.affinity").setLevel(logging.DEBUG)
engines = {e["id"]: Engine(e["id"], e["role"], e["host"], (e["id"],), port=e["port"],
                           block_size=e["block_size"], block_bytes=e["block_bytes"],
                           num_blocks=e["num_blocks"]) for e in conf["engines"]}
decodes = [e for e, v in engines.items() if v.role == "decode"]
prefills = tuple(e for e, v in engines.items() if v.role == "prefill")
table = RoutingTable({d: prefills for d in decodes}, engines,
                     transports={(d, p): "cma" for d in decodes for p in prefills})
settings = RouterSettings(chooser=ChooserSettings(**conf["chooser"]),
                          tracking=TrackingSettings(**conf["tracking"]))
web.run_app(Router(lambda: table, settings).app(), host="127.0.0.1", port=conf["port"],
            print=None, access_log=None, handler_cancellation=True)
"""


# -- prompts ----------------------------------------------------------------------------------
def words(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
            for _ in range(count)]  # fmt: skip


async def tokens(s: aiohttp.ClientSession, engine: OpenAIServer, text: str) -> int:
    async with s.post(f"{engine.url}/tokenize", json={"model": vp.MODEL, "prompt": text}) as r:
        assert r.status == 200, await r.text()
        return len((await r.json())["tokens"])


async def system_prompt(s: aiohttp.ClientSession, engine: OpenAIServer, rng: random.Random
                        ) -> tuple[str, int]:  # fmt: skip
    """Random words ending in a newline, ``SYSTEM_TOKENS`` tokens long where the words allow
    (the longest run of words that fits, then up to 8 one-token dots), and its token count.
    Each word is a pre-token of its own, so the count grows with the words, and the prompt's
    tokens are a prefix of the tokens of the prompt with a question after it."""
    pool = words(rng, SYSTEM_TOKENS)
    low, high = 0, len(pool)          # the most words whose text fits
    while low < high:
        mid = (low + high + 1) // 2
        if await tokens(s, engine, " ".join(pool[:mid]) + "\n") <= SYSTEM_TOKENS:
            low = mid
        else:
            high = mid - 1
    text = " ".join(pool[:low])
    short = SYSTEM_TOKENS - await tokens(s, engine, text + "\n")
    text += "." * min(max(short, 0), 8) + "\n"
    return text, await tokens(s, engine, text)


def question(rng: random.Random, chars_per_token: float) -> str:
    target = rng.randint(*QUESTION_TOKENS) * chars_per_token
    out: list[str] = []
    while len(" ".join(out)) + 2 < target:
        out += words(rng, 1)
    return "Question: " + " ".join(out) + "?"


def unique_prompt(rng: random.Random, chars_per_token: float) -> str:
    """A control prompt: a fresh text about as long as a system prompt, then a question."""
    out: list[str] = []
    while len(" ".join(out)) < SYSTEM_TOKENS * chars_per_token:
        out += words(rng, 1)
    return " ".join(out) + "\n" + question(rng, chars_per_token)


# -- requests ---------------------------------------------------------------------------------
def body(prompt: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    out = vp.completion(prompt, max_tokens, **extra)
    out.pop("return_token_ids", None)
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


async def streamed(s: aiohttp.ClientSession, url: str, request: dict[str, Any], began: float
                   ) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """Seconds from ``began`` to the stream's first event, and its usage."""
    first, usage = None, {}
    async with s.post(url, json=request) as r:
        assert r.status == 200, f"{url}: HTTP {r.status}: {(await r.text())[:500]}"
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            if first is None:
                first = time.perf_counter() - began
            event = json.loads(data)
            assert "error" not in event, f"{url}: {event}"
            usage = event.get("usage") or usage
    assert first is not None, f"{url}: no event"
    return first, usage


async def direct(s: aiohttp.ClientSession, prefill: OpenAIServer, decode: OpenAIServer,
                 prompt: str) -> tuple[float, float]:  # fmt: skip
    """vLLM's P/D flow sent by hand (what the router does): the prefill call's seconds and
    the TTFT."""
    began = time.perf_counter()
    async with s.post(f"{prefill.url}/v1/completions", json=body(
            prompt, 1, False, kv_transfer_params={"do_remote_decode": True})) as r:
        assert r.status == 200, await r.text()
        params = (await r.json())["kv_transfer_params"]
    prefilled = time.perf_counter() - began
    ttft, _ = await streamed(s, f"{decode.url}/v1/completions",
                             body(prompt, MAX_TOKENS, True, kv_transfer_params=params), began)
    return prefilled, ttft


# -- metrics ----------------------------------------------------------------------------------
SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(prefix):
            match = SAMPLE.match(line)
            if match:
                out.append((match[1], dict(LABEL.findall(match[2] or "")), float(match[3])))
    return out


async def get_text(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return await r.text()


async def engine_counters(s: aiohttp.ClientSession, engines: dict[str, OpenAIServer]
                          ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per engine: prompt tokens by source, and finished requests."""
    out: dict[str, dict[str, float]] = {}
    for name, engine in engines.items():
        counts: dict[str, float] = {}
        for metric, labels, value in samples(await get_text(s, f"{engine.url}/metrics"), "vllm:"):
            if metric == "vllm:prompt_tokens_by_source_total":
                counts[labels["source"]] = counts.get(labels["source"], 0.0) + value
            elif metric == "vllm:request_success_total":
                counts["requests"] = counts.get("requests", 0.0) + value
        out[name] = counts
    return out


async def reset_caches(s: aiohttp.ClientSession, engines: dict[str, OpenAIServer]) -> None:
    """Every engine's prefix cache emptied; vLLM refuses while blocks are held (a prefill's
    blocks wait for their decode's read), so each is asked again until it agrees."""
    for name, engine in engines.items():
        deadline = time.monotonic() + 120
        while True:
            async with s.post(f"{engine.url}/reset_prefix_cache") as r:
                assert r.status == 200, f"{name}: reset_prefix_cache: HTTP {r.status}"
                if (await r.json()).get("success"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: prefix cache not reset within 120 s")
            await asyncio.sleep(1)


# -- the router ------------------------------------------------------------------------------
@dataclass
class Calibration:
    prefill_ms_per_block: float
    queue_ms: float
    cma_gbps: float


class RouterProcess:
    def __init__(self, work: Path, engines: dict[str, OpenAIServer], events_port: int,
                 policy: str, calib: Calibration, tag: str) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = {
            "port": self.port,
            "engines": [{"id": n, "role": ENGINES[n][0], "host": e.host, "port": e.port,
                         "block_size": BLOCK, "block_bytes": BLOCK_BYTES,
                         "num_blocks": NUM_BLOCKS} for n, e in engines.items()],
            "chooser": {"policy": policy, "prefill_ms_per_block": calib.prefill_ms_per_block,
                        "queue_ms": calib.queue_ms, "balance_factor": BALANCE_FACTOR,
                        "transport_gbps": {"cma": calib.cma_gbps}},
            "tracking": {"kv_events_port": events_port, "default_block_size": BLOCK},
        }  # fmt: skip
        self.log = work / f"router-{tag}.log"
        self.proc = subprocess.Popen([sys.executable, "-c", ROUTER, json.dumps(conf)],
                                     stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    async def wait_ready(self, s: aiohttp.ClientSession, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log.read_text()[-3000:]}")
            try:
                async with s.get(f"{self.url}/health",
                                 timeout=aiohttp.ClientTimeout(total=2)) as r:  # fmt: skip
                    if r.status == 200:
                        await asyncio.sleep(2)   # subscribers connected, loads read once
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"router not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)


def router_stats(text: str) -> dict[str, Any]:
    pairs: dict[str, float] = {}
    hits: dict[str, float] = {}
    events: dict[str, float] = {}
    errors = 0.0
    for metric, labels, value in samples(text, "kvbridge_router_"):
        if metric == "kvbridge_router_requests_total" and labels.get("prefill"):
            key = f"{labels['prefill']}->{labels['decode']}:{labels['outcome']}"
            pairs[key] = pairs.get(key, 0.0) + value
        elif metric == "kvbridge_router_pick_cache_hit_blocks_sum":
            hits[labels["role"]] = value
        elif metric == "kvbridge_router_pick_prompt_blocks_sum":
            hits["prompt"] = value
        elif metric == "kvbridge_router_kv_event_blocks_total":
            events[labels["action"]] = value
        elif metric in ("kvbridge_router_kv_event_errors_total",
                        "kvbridge_router_tokenize_failures_total", "kvbridge_router_retries_total"):
            errors += value
    return {"pairs": pairs, "index_hit_blocks": hits, "kv_event_blocks": events,
            "errors": errors}  # fmt: skip


# -- runs -------------------------------------------------------------------------------------
@dataclass
class Run:
    workload: str
    policy: str
    round: int
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    router: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def served(self) -> dict[str, float]:
        """Requests answered per engine (the router's count by pair)."""
        out = dict.fromkeys(ENGINES, 0.0)
        for key, n in self.router.get("pairs", {}).items():
            pair, outcome = key.split(":")
            if outcome == "answered":
                prefill, decode = pair.split("->")
                out[prefill] += n
                out[decode] += n
        return out


async def run_once(s: aiohttp.ClientSession, work: Path, engines: dict[str, OpenAIServer],
                   events_port: int, calib: Calibration, run: Run, prompts: list[str]
                   ) -> None:  # fmt: skip
    await reset_caches(s, engines)
    router = RouterProcess(work, engines, events_port, run.policy, calib,
                           f"{run.workload}-{run.policy}-r{run.round}")  # fmt: skip
    try:
        await router.wait_ready(s)
        before = await engine_counters(s, engines)
        queue = list(reversed(prompts))

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                began = time.perf_counter()
                ttft, usage = await streamed(s, f"{router.url}/v1/completions",
                                             body(prompt, MAX_TOKENS, True), began)
                run.ttft.append(ttft)
                run.prompt_tokens.append(int(usage.get("prompt_tokens", 0)))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        run.wall_s = time.perf_counter() - began
        await asyncio.sleep(1.5)       # the engines' last counters
        after = await engine_counters(s, engines)
        run.counters = {n: {k: after[n].get(k, 0.0) - before[n].get(k, 0.0) for k in after[n]}
                        for n in engines}  # fmt: skip
        run.router = router_stats(await get_text(s, f"{router.url}/metrics"))
    finally:
        router.stop()
    c = run.counters
    print(json.dumps({
        "run": f"{run.workload}/{run.policy}/r{run.round}", "wall_s": round(run.wall_s, 1),
        "ttft_p50_ms": round(pct(run.ttft, 50) * 1e3, 1),
        "ttft_p90_ms": round(pct(run.ttft, 90) * 1e3, 1),
        "prefill_computed": sum(c[n].get("local_compute", 0) for n in ("p0", "p1")),
        "prefill_cache_hit": sum(c[n].get("local_cache_hit", 0) for n in ("p0", "p1")),
        "decode_pulled_tokens": sum(c[n].get("external_kv_transfer", 0) for n in ("d0", "d1")),
        "decode_cache_hit": sum(c[n].get("local_cache_hit", 0) for n in ("d0", "d1")),
        "served": run.served(), "router": run.router, "loadavg_1m": os.getloadavg()[0],
    }), file=sys.stderr, flush=True)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def ratio(value: float, base: float) -> float:
    if base > 0:
        return value / base
    return 1.0 if value == 0 else float(value)


def spread(runs: list[Run]) -> float:
    """The largest engine's requests over its role's mean, the runs' counts summed."""
    served = dict.fromkeys(ENGINES, 0.0)
    for run in runs:
        for name, n in run.served().items():
            served[name] += n
    worst = 0.0
    for role in ("prefill", "decode"):
        counts = [served[n] for n, (r, _h) in ENGINES.items() if r == role]
        mean = sum(counts) / len(counts)
        worst = max(worst, max(counts) / mean if mean else 0.0)
    return worst


def summarize(workload: str, runs: list[Run], sizes: dict[str, Any]) -> None:
    by = {p: [r for r in runs if r.workload == workload and r.policy == p] for p in POLICIES}

    def merged(policy: str) -> dict[str, float]:
        rs = by[policy]
        n = sum(len(r.ttft) for r in rs)
        ttft = [t for r in rs for t in r.ttft]
        pulled = sum(r.counters[d].get("external_kv_transfer", 0) for r in rs for d in ("d0", "d1"))
        computed = sum(r.counters[p].get("local_compute", 0) for r in rs for p in ("p0", "p1"))
        return {"p50": pct(ttft, 50) * 1e3, "p90": pct(ttft, 90) * 1e3,
                "bytes": pulled * TOKEN_BYTES / n, "prefill": computed / n,
                "spread": spread(rs), "requests": n}  # fmt: skip

    ours, base = merged("cache-aware"), merged("least-load")
    load = os.getloadavg()[0]
    per_round = {p: [{"round": r.round, "ttft_p50_ms": round(pct(r.ttft, 50) * 1e3, 1),
                      "wall_s": round(r.wall_s, 1), "served": r.served()} for r in by[p]]
                 for p in POLICIES}  # fmt: skip
    extra = {"requests": ours["requests"], "concurrency": CONCURRENCY, **sizes,
             "loadavg_1m": load}  # fmt: skip
    for key, unit, label in (("p50", "ms", "ttft_p50"), ("p90", "ms", "ttft_p90"),
                             ("bytes", "B", "kv_bytes_per_request"),
                             ("prefill", "tokens", "prefill_tokens_per_request")):
        emit(f"prefix.{label}.{workload}", ours[key], unit,
             f"least-load {base[key]:.1f} {unit}", ratio(ours[key], base[key]),
             target=target(workload, label), **extra)  # fmt: skip
    emit(f"prefix.load_spread.{workload}", ours["spread"], "x role mean",
         f"least-load {base['spread']:.2f}x", ratio(ours["spread"], base["spread"]),
         target=target(workload, "load_spread"), per_round=per_round, **extra)  # fmt: skip


def target(workload: str, label: str) -> str | None:
    goal = TARGETS[workload]
    return goal if isinstance(goal, str) else goal.get(label)


# -- calibration ------------------------------------------------------------------------------
async def calibrate(s: aiohttp.ClientSession, engines: dict[str, OpenAIServer],
                    chars_per_token: float) -> Calibration:  # fmt: skip
    """On idle engines, fresh prompts of a system prompt's size plus a question: a cold P/D
    request on (p0, d0), the same again (both hold it: the fixed cost of a request), and the
    same on (p0, d1) (the prefill holds it, the decode pulls all of it)."""
    rng = random.Random(77)
    p0, d0, d1 = engines["p0"], engines["d0"], engines["d1"]
    cold, warm, pull, per_block, ntok = [], [], [], [], []
    for _ in range(3):
        prompt = unique_prompt(rng, chars_per_token)
        n = await tokens(s, p0, prompt)
        pc, tc = await direct(s, p0, d0, prompt)
        pw, tw = await direct(s, p0, d0, prompt)
        _, tp = await direct(s, p0, d1, prompt)
        cold.append(tc)
        warm.append(tw)
        pull.append(tp - tw)
        per_block.append((pc - pw) / (n / BLOCK))
        ntok.append(n)
    c, w = statistics.median(cold), statistics.median(warm)
    pull_s = statistics.median(pull)
    pulled_bytes = statistics.median(ntok) // BLOCK * BLOCK_BYTES
    gbps = pulled_bytes / pull_s / 1e9 if pull_s > 0.001 else 10.0
    calib = Calibration(round(statistics.median(per_block) * 1e3, 2), round(w * 1e3, 1),
                        round(gbps, 3))  # fmt: skip
    load = os.getloadavg()[0]
    emit("prefix.cold_vs_warm_ttft", c * 1e3, "ms",
         f"warm repeat (prefix held by prefill and decode) {w * 1e3:.1f} ms", c / w,
         prompt_tokens=statistics.median(ntok), cold_ms=[round(x * 1e3, 1) for x in cold],
         warm_ms=[round(x * 1e3, 1) for x in warm], pair="p0->d0 direct, idle",
         loadavg_1m=load)  # fmt: skip
    emit("prefix.calibration.prefill_ms_per_block", calib.prefill_ms_per_block, "ms",
         "measured: (cold - cached prefill call) / prompt blocks", 1.0,
         queue_ms=calib.queue_ms, cma_gbps=calib.cma_gbps,
         pull_ms=[round(x * 1e3, 1) for x in pull], pull_bytes=pulled_bytes,
         balance_factor=BALANCE_FACTOR, balance_slack=ChooserSettings().balance_slack,
         eviction_weight=ChooserSettings().eviction_weight, loadavg_1m=load)  # fmt: skip
    return calib


async def warm_up(s: aiohttp.ClientSession, engines: dict[str, OpenAIServer],
                  chars_per_token: float) -> None:  # fmt: skip
    """Every pair's handshake and every engine's first (slow) long prompt, out of the way."""
    rng = random.Random(5)
    for p in ("p0", "p1"):
        for d in ("d0", "d1"):
            await direct(s, engines[p], engines[d], unique_prompt(rng, chars_per_token))


async def measure(work: Path, engines: dict[str, OpenAIServer], events_port: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        rng = random.Random(2024)
        p0 = engines["p0"]
        probe = " ".join(words(rng, 400))
        chars_per_token = len(probe) / await tokens(s, p0, probe)
        await warm_up(s, engines, chars_per_token)
        systems = [await system_prompt(s, p0, rng) for _ in range(TENANTS)]
        sizes = {"tenants": TENANTS, "system_tokens": sorted({n for _t, n in systems}),
                 "question_tokens": list(QUESTION_TOKENS), "max_tokens": MAX_TOKENS,
                 "block_tokens": BLOCK, "block_bytes": BLOCK_BYTES,
                 "num_gpu_blocks": NUM_BLOCKS, "model": {k: MODEL_CONFIG[k] for k in (
                     "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim")}}  # fmt: skip
        calib = await calibrate(s, engines, chars_per_token)
        print(json.dumps({"calibration": calib.__dict__, "sizes": sizes}), file=sys.stderr)
        runs: list[Run] = []
        for rnd in (1, 2):
            rr = random.Random(1000 + rnd)
            shared = [systems[rr.randrange(TENANTS)][0] + question(rr, chars_per_token)
                      for _ in range(REQUESTS)]  # fmt: skip
            control = [unique_prompt(rr, chars_per_token) for _ in range(REQUESTS)]
            order = POLICIES if rnd == 1 else tuple(reversed(POLICIES))
            for workload, prompts in (("shared", shared), ("control", control)):
                for policy in order:
                    run = Run(workload, policy, rnd)
                    await run_once(s, work, engines, events_port, calib, run, prompts)
                    runs.append(run)
        for workload in WORKLOADS:
            summarize(workload, runs, sizes)


def main() -> int:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-prefix-"))
    model = write_test_model(work / "model", seed=11, config=MODEL_CONFIG)
    events_port = free_port()
    engines: dict[str, OpenAIServer] = {}
    for name, (role, host) in ENGINES.items():
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://[::ffff:{host}]:{events_port}"}  # fmt: skip
        engines[name] = OpenAIServer(
            model, work, name, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, host=host,
            connector=connector_config(engine_id=name),
            env={"KVBRIDGE_ROLE": role, "VLLM_SERVER_DEV_MODE": "1"},
            extra_args=["--enable-prefix-caching", "--kv-events-config", json.dumps(events)])
    try:
        start_servers(*engines.values())
        print(f"bench_prefix: engines up in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        asyncio.run(measure(work, engines, events_port))
    finally:
        for engine in engines.values():
            engine.stop()
    print(f"bench_prefix: {time.monotonic() - started:.0f} s; logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
