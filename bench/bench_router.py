"""kvbridge-router against the same two calls made directly by the client, on the same real
vLLM engines and prompts.

Engines: a prefill and a decode ``vllm serve`` OpenAI server (the vLLM venv of
hack/vllm-venv.sh, the CPU build, KVBridgeConnector, the tiny test model of
``kvbridge write-test-model``), each its own process. The router runs in a process of its
own with a fixed routing table naming that pair (the table the KVTransfer watch would build;
no control plane is involved), so the only difference between the two sides is the router's
hop: parsing, pair choice, the prefill call, the decode call and the relay of the answer.

At each concurrency (1, 8, 32) the client sends rounds of requests, alternating direct and
routed rounds so that drift and noise hit both alike. Every request has a fresh prompt (no
prefix-cache hit anywhere), ``max_tokens`` 8, greedy, non-streaming (``vllm_pods.completion``).

- ``router.added_latency_p50.cN`` / ``_p99``: routed minus direct request latency at those
  percentiles (ms; ``ratio`` = routed / direct; lower is better). Target: at most 2 ms at p50.
- ``router.throughput.cN``: routed requests per second (``ratio`` = routed / direct; higher
  is better). Target: at least 0.97.

Never asserts on timing. ``loadavg_1m`` says how busy the machine was.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from _common import emit
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.vllm_servers import OpenAIServer, start_servers

CONCURRENCY = (1, 8, 32)
REQUESTS = int(os.environ.get("KVB_BENCH_ROUTER_REQUESTS", "64"))
MAX_TOKENS = 8
ROUTER = """
import asyncio, sys
from aiohttp import web
from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.table import Engine, RoutingTable
port, prefill, decode = (int(a) for a in sys.argv[1:4])
table = RoutingTable({"d": ("p",)}, {
    "p": Engine("p", "prefill", "127.0.0.1", ("p",), port=prefill),
    "d": Engine("d", "decode", "127.0.0.1", ("d",), port=decode)})
web.run_app(Router(lambda: table, RouterSettings()).app(), host="127.0.0.1", port=port,
            print=None, access_log=None, handler_cancellation=True)
"""


async def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


async def direct(s: aiohttp.ClientSession, prefill: str, decode: str, prompt: str) -> None:
    async with s.post(f"{prefill}/v1/completions", json=vp.completion(
            prompt, 1, kv_transfer_params={"do_remote_decode": True})) as r:
        params = (await r.json())["kv_transfer_params"]
    async with s.post(f"{decode}/v1/completions",
                      json=vp.completion(prompt, MAX_TOKENS, kv_transfer_params=params)) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def routed(s: aiohttp.ClientSession, router: str, prompt: str) -> None:
    async with s.post(f"{router}/v1/completions", json=vp.completion(prompt, MAX_TOKENS)) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def round_of(send: Any, prompts: list[str], concurrency: int) -> tuple[list[float], float]:
    """Latencies of ``prompts`` sent ``concurrency`` at a time, and the round's wall time."""
    latencies: list[float] = []
    queue = list(prompts)

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            started = time.perf_counter()
            await send(prompt)
            latencies.append(time.perf_counter() - started)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - began


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def measure(prefill: str, decode: str, router: str) -> None:
    rng = random.Random(5)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def send_direct(p: str) -> None:
            await direct(s, prefill, decode, p)

        async def send_routed(p: str) -> None:
            await routed(s, router, p)

        await round_of(send_direct, vp.prompts(4, seed=1), 2)      # handshake, warm-up
        await round_of(send_routed, vp.prompts(4, seed=2), 2)
        for c in CONCURRENCY:
            lat: dict[str, list[float]] = {"direct": [], "routed": []}
            wall = {"direct": 0.0, "routed": 0.0}
            for rep in range(4):
                order = ("direct", "routed") if rep % 2 == 0 else ("routed", "direct")
                for side in order:
                    prompts = [f"r{rng.random():.9f} " + p
                               for p in vp.prompts(REQUESTS // 4, seed=rng.randrange(10**6))]
                    send = send_direct if side == "direct" else send_routed
                    got, took = await round_of(send, prompts, c)
                    lat[side] += got
                    wall[side] += took
            load = os.getloadavg()[0]
            for q in (50, 99):
                base, ours = percentile(lat["direct"], q), percentile(lat["routed"], q)
                emit(f"router.added_latency_p{q}.c{c}", (ours - base) * 1e3, "ms",
                     f"direct two calls p{q} {base * 1e3:.1f} ms", ours / base,
                     routed_ms=ours * 1e3, direct_ms=base * 1e3, requests=len(lat["routed"]),
                     loadavg_1m=load)  # fmt: skip
            tput = {k: len(lat[k]) / wall[k] for k in wall}
            emit(f"router.throughput.c{c}", tput["routed"], "req/s",
                 f"direct two calls {tput['direct']:.1f} req/s",
                 tput["routed"] / tput["direct"], higher_is_better=True, loadavg_1m=load)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-router-"))
    from kvbridge_agent._testmodel import write_test_model

    model = write_test_model(work / "model", seed=9)
    prefill = OpenAIServer(model, work, "prefill", env={"KVBRIDGE_ROLE": "prefill"})
    decode = OpenAIServer(model, work, "decode", env={"KVBRIDGE_ROLE": "decode"})
    port = free_port()
    router = None
    try:
        start_servers(prefill, decode)
        router = subprocess.Popen(
            [sys.executable, "-c", ROUTER, str(port), str(prefill.port), str(decode.port)],
            stdout=(work / "router.log").open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        async def run() -> None:
            await wait_ready(f"{url}/health", 30)
            await measure(prefill.url, decode.url, url)
        asyncio.run(run())
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        prefill.stop()
        decode.stop()
    print(f"bench_router: logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
