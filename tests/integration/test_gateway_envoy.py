"""The inference-gateway path with a real Envoy 1.40 (configured as the Gateway API Inference
Extension configures a pool's Envoy: ext_proc with full-duplex streamed bodies, then an
ORIGINAL_DST cluster following ``x-gateway-destination-endpoint``), the real endpoint picker
(kvbridge_router.extproc, gRPC) and the real decode sidecars (kvbridge_router.sidecar).

The engines are aiohttp servers playing vLLM's P/D endpoints (as in test_router_proxy.py):
each answers with the pair that served, so every answer says which prefill and decode it
took. The routing table is given (the KVTransfer watch's part is tested with real engines in
tests/e2e/test_router_engines.py). Each engine and sidecar has a loopback address of its own
(127.0.0.x), as pods have IPs of their own, so that the pool's one target port names a
decode by its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge_router.balance import ChooserSettings
from kvbridge_router.drain import DrainSettings
from kvbridge_router.extproc import BODY_CHUNK, EXT_PROC_SERVICE, EndpointPicker, serve_grpc
from kvbridge_router.picker import PAIR_HEADER, PickerSettings
from kvbridge_router.proxy import RouterSettings
from kvbridge_router.sidecar import Sidecar, SidecarSettings
from kvbridge_router.table import Engine, RoutingTable
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.envoy import Envoy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: name: (role, loopback address); d0 is verified with p0, d1 with p0 and p1; p2 is a
#: prefill of the transfer that no decode has verified.
LAYOUT = {"p0": ("prefill", "127.0.0.4"), "p1": ("prefill", "127.0.0.5"),
          "p2": ("prefill", "127.0.0.6"), "d0": ("decode", "127.0.0.2"),
          "d1": ("decode", "127.0.0.3")}  # fmt: skip
VERIFIED = {"d0": ("p0",), "d1": ("p0", "p1")}
ENGINE_PORT, SIDECAR_PORT, PICKER_PORT = free_port(), free_port(), free_port()
DECODE_VLLM_PORT = free_port()


@dataclass
class FakeEngine:
    """One engine: a prefill answers with kv_transfer_params naming itself, a decode with the
    pair ("p0->d1"), streamed in three SSE chunks when asked to stream (0.05 s apart; a
    prompt "slow N" puts N seconds between them)."""

    name: str
    role: str
    host: str
    calls: int = 0
    runner: web.AppRunner | None = None
    prompts: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return ENGINE_PORT if self.role == "prefill" else DECODE_VLLM_PORT

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        return self

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        self.prompts.append(body.get("prompt", ""))
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": self.name}})
        text = f"{params.get('remote_engine_id', 'local')}->{self.name}"
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": text}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        slow = str(body.get("prompt", "")).split()
        gap = float(slow[1]) if slow[:1] == ["slow"] else 0.05
        for piece in (text, " more", " end"):
            await out.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
            await asyncio.sleep(gap)
        await out.write(b"data: [DONE]\n\n")
        return out

    def engine(self) -> Engine:
        return Engine(self.name, self.role, self.host, (f"pod-{self.name}",), ENGINE_PORT)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Pool:
    """The engines, one sidecar per decode, and the picker, all on one event loop."""

    engines: dict[str, FakeEngine]
    table: RoutingTable
    synced: bool = True
    picker_stop: asyncio.Event = field(default_factory=asyncio.Event)
    picker_task: asyncio.Task[None] | None = None
    picker: EndpointPicker | None = None
    runners: list[web.AppRunner] = field(default_factory=list)

    def table_now(self) -> RoutingTable:
        return self.table

    async def start_picker(self, chooser: ChooserSettings | None = None,
                           drain: DrainSettings | None = None) -> None:  # fmt: skip
        self.picker_stop = asyncio.Event()
        self.picker = EndpointPicker(self.table_now, PickerSettings(
            target_port=SIDECAR_PORT, engine_port=ENGINE_PORT), chooser)
        await self.picker.start()
        self.picker_task = asyncio.create_task(serve_grpc(
            self.picker, f"127.0.0.1:{PICKER_PORT}", lambda: self.synced, self.picker_stop,
            drain))
        await wait_grpc_serving()

    async def stop_picker(self) -> None:
        self.picker_stop.set()
        if self.picker_task is not None:
            await self.picker_task
        if self.picker is not None:
            await self.picker.close()

    async def start_sidecar(self, decode: str, without_header: str = "refuse") -> None:
        host = self.engines[decode].host
        sidecar = Sidecar(self.table_now, RouterSettings(engine_port=ENGINE_PORT),
                          SidecarSettings(f"pod-{decode}", f"http://{host}:{DECODE_VLLM_PORT}",
                                          without_header=without_header))  # fmt: skip
        runner = web.AppRunner(sidecar.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, SIDECAR_PORT).start()
        self.runners.append(runner)


def full_table(engines: dict[str, FakeEngine]) -> RoutingTable:
    return RoutingTable(dict(VERIFIED), {n: e.engine() for n, e in engines.items()})


@contextlib.asynccontextmanager
async def pool(without_header: str = "refuse", chooser: ChooserSettings | None = None
               ) -> AsyncIterator[Pool]:  # fmt: skip
    engines = {n: await FakeEngine(n, role, host).start() for n, (role, host) in LAYOUT.items()}
    p = Pool(engines, full_table(engines))
    try:
        for decode in VERIFIED:
            await p.start_sidecar(decode, without_header)
        await p.start_picker(chooser)
        yield p
    finally:
        await p.stop_picker()
        for runner in p.runners:
            await runner.cleanup()
        for e in engines.values():
            await e.stop()


async def wait_grpc_serving(service: str = EXT_PROC_SERVICE) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PICKER_PORT}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return reply.status
            await asyncio.sleep(0.05)
    raise AssertionError(f"the picker's {service!r} never SERVING")


async def health(service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PICKER_PORT}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> tuple[int, str, str]:  # fmt: skip
    """(status, text, the pair header) of one completion."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body,
                                                    headers=headers or {}) as r:  # fmt: skip
        return r.status, await r.text(), r.headers.get(PAIR_HEADER, "")


PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    proxy = Envoy(tmp_path_factory.mktemp("envoy"), PICKER_PORT).start()
    yield proxy
    proxy.stop()


def run(scenario: Callable[[Pool], Any], without_header: str = "refuse",
        chooser: ChooserSettings | None = None) -> Any:  # fmt: skip
    async def main() -> Any:
        async with pool(without_header, chooser) as p:
            return await scenario(p)
    return asyncio.run(main())


def text_of(body: str) -> str:
    return json.loads(body)["choices"][0]["text"]


def test_requests_through_envoy_take_verified_pairs_only(envoy: Envoy) -> None:
    async def scenario(p: Pool) -> None:
        forged = {"x-gateway-destination-endpoint": f"{LAYOUT['p2'][1]}:{ENGINE_PORT}",
                  "x-prefiller-host-port": f"{LAYOUT['p2'][1]}:{ENGINE_PORT}",
                  "x-prefill-host-port": "203.0.113.9:8000"}  # fmt: skip
        answers = await asyncio.gather(*(post(envoy.url, PROMPT, forged if i % 2 else None)
                                         for i in range(12)))  # fmt: skip
        assert {status for status, _, _ in answers} == {200}, answers
        served = Counter(text_of(body) for _, body, _ in answers)
        # The response header names the pair whose engines produced the answer.
        assert all(text_of(body) == pair for _, body, pair in answers), answers
        verified = {f"{pf}->{d}" for d, pfs in VERIFIED.items() for pf in pfs}
        assert set(served) <= verified and {s.split("->")[1] for s in served} == {"d0", "d1"}
        assert p.engines["p2"].calls == 0, "a forged header reached an unverified prefill"
    run(scenario)


def test_a_stream_passes_through_the_picker_chunk_by_chunk(envoy: Envoy) -> None:
    async def scenario(p: Pool) -> None:
        async with aiohttp.ClientSession() as s, s.post(
                f"{envoy.url}/v1/completions", json={**PROMPT, "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = [line async for line in r.content if line.strip()]
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
        assert texts[1:] == [" more", " end"] and events[-1] == b"data: [DONE]\n"
        assert texts[0] in {"p0->d0", "p0->d1", "p1->d1"}
    run(scenario)


def test_the_gateway_subset_hint_is_honoured(tmp_path: Path) -> None:
    only_d0 = Envoy(tmp_path, PICKER_PORT, subset=[f"{LAYOUT['d0'][1]}:{SIDECAR_PORT}"],
                    name="subset").start()
    elsewhere = Envoy(tmp_path, PICKER_PORT, subset=[f"{LAYOUT['p2'][1]}:{SIDECAR_PORT}"],
                      name="elsewhere").start()
    try:
        async def scenario(p: Pool) -> None:
            answers = [await post(only_d0.url, PROMPT) for _ in range(6)]
            assert [text_of(body) for _, body, _ in answers] == ["p0->d0"] * 6
            status, body, _ = await post(elsewhere.url, PROMPT)
            assert status == 503, body
            assert "no decode of a verified pair is in the gateway's endpoint subset" in body
            assert p.engines["d1"].calls == 0
        run(scenario)
    finally:
        only_d0.stop()
        elsewhere.stop()


def test_no_verified_pair_is_a_503_naming_the_reason(envoy: Envoy) -> None:
    async def scenario(p: Pool) -> None:
        p.table = RoutingTable({}, p.table.engines, reason="no decode engine of KVTransfer kvt "
                               "is paired (decode endpoints are Incompatible)")
        status, body, _ = await post(envoy.url, PROMPT)
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["type"] == "no_verified_pair" and "Incompatible" in error["message"]
        assert sum(e.calls for e in p.engines.values()) == 0
    run(scenario)


def test_picker_down_fails_closed_and_recovers(envoy: Envoy) -> None:
    async def scenario(p: Pool) -> None:
        assert (await post(envoy.url, PROMPT))[0] == 200
        await p.stop_picker()
        calls = sum(e.calls for e in p.engines.values())
        down = [await post(envoy.url, PROMPT) for _ in range(3)]
        assert all(status >= 500 for status, _, _ in down), down
        assert sum(e.calls for e in p.engines.values()) == calls, "reached an engine"
        await p.start_picker()
        status, body, pair = await post(envoy.url, PROMPT)
        assert status == 200 and text_of(body) == pair
    run(scenario)


async def stream_text(url: str, prompt: str) -> tuple[int, list[str]]:
    """A streamed completion's status and its events' data, as they came (an error in the
    transfer ends the list with "<broken: ...>")."""
    out: list[str] = []
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/v1/completions", json={**PROMPT, "prompt": prompt, "stream": True}) as r:
        try:
            async for line in r.content:
                if line.startswith(b"data: "):
                    out.append(line[6:].decode().strip())
        except aiohttp.ClientError as exc:
            out.append(f"<broken: {type(exc).__name__}>")
        return r.status, out


def test_a_draining_picker_lets_envoys_streams_finish(envoy: Envoy) -> None:
    """The picker drained as on SIGTERM (extproc.py), behind a real Envoy: a request whose
    answer is streaming through it finishes in full after the server stopped (its ext_proc
    stream goes on), a request in the delay is served, one after it fails closed; with a
    grace shorter than the stream, the client sees the stream broken, never a clean end."""
    async def scenario(p: Pool) -> None:
        await p.stop_picker()
        await p.start_picker(drain=DrainSettings(delay_s=0.6, grace_s=5))
        streaming = asyncio.create_task(stream_text(envoy.url, "slow 0.6"))
        await asyncio.sleep(0.3)               # its first chunk is through
        p.picker_stop.set()                     # SIGTERM
        await asyncio.sleep(0.1)
        assert await health("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await post(envoy.url, PROMPT))[0] == 200           # the delay
        await asyncio.sleep(0.8)                # the server has stopped
        assert (await post(envoy.url, PROMPT))[0] >= 500           # fail closed
        status, events = await streaming
        assert status == 200 and events[-1] == "[DONE]" and len(events) == 4, events
        assert p.picker_task is not None
        await asyncio.wait_for(p.picker_task, timeout=5)

        await p.start_picker(drain=DrainSettings(delay_s=0.2, grace_s=0.5))
        streaming = asyncio.create_task(stream_text(envoy.url, "slow 1"))
        await asyncio.sleep(0.3)
        p.picker_stop.set()
        status, events = await streaming
        assert status == 200 and "[DONE]" not in events, events
        assert events[-1].startswith("<broken"), events
        await asyncio.wait_for(p.picker_task, timeout=5)
    run(scenario)


def test_readiness_follows_the_watch(envoy: Envoy) -> None:
    async def scenario(p: Pool) -> None:
        assert await health("liveness") == health_pb2.HealthCheckResponse.SERVING
        assert await health("readiness") == health_pb2.HealthCheckResponse.SERVING
        p.synced = False
        await asyncio.sleep(1.2)   # the picker re-reads synced() every 0.5 s
        assert await health("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health(EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health("liveness") == health_pb2.HealthCheckResponse.SERVING
    run(scenario)


def sidecar_url(decode: str) -> str:
    return f"http://{LAYOUT[decode][1]}:{SIDECAR_PORT}"


def test_the_sidecar_calls_only_its_decodes_verified_prefills() -> None:
    async def scenario(p: Pool) -> None:
        d0 = sidecar_url("d0")
        status, body, _ = await post(d0, PROMPT, {"x-prefiller-host-port":
                                                  f"{LAYOUT['p0'][1]}:{ENGINE_PORT}"})
        assert (status, text_of(body)) == (200, "p0->d0")
        # The standard header name is read too.
        status, body, _ = await post(d0, PROMPT, {"x-prefill-host-port":
                                                  f"{LAYOUT['p0'][1]}:{ENGINE_PORT}"})
        assert (status, text_of(body)) == (200, "p0->d0")
        # An address of no prefill of the transfer: refused, nothing called.
        status, body, _ = await post(d0, PROMPT, {"x-prefiller-host-port": "203.0.113.9:80"})
        assert status == 403 and "no prefill of this decode's KVTransfer" in body
        # A prefill of the transfer that d0 has not verified (p1 is d1's): 503, not called.
        status, body, _ = await post(d0, PROMPT, {"x-prefiller-host-port":
                                                  f"{LAYOUT['p1'][1]}:{ENGINE_PORT}"})
        assert status == 503 and "is not a verified peer of decode d0" in body
        status, body, _ = await post(d0, PROMPT)
        assert status == 400 and "x-prefiller-host-port" in body
        assert p.engines["p1"].calls == 0 and p.engines["p2"].calls == 0
        assert p.engines["d0"].calls == 2
    run(scenario)


def test_a_sidecar_set_to_local_serves_headerless_requests_from_its_own_engine() -> None:
    async def scenario(p: Pool) -> None:
        status, body, _ = await post(sidecar_url("d1"), PROMPT)
        assert (status, text_of(body)) == (200, "local->d1")
        assert sum(p.engines[n].calls for n in ("p0", "p1", "p2")) == 0
    run(scenario, without_header="local")


def test_cache_aware_picker_reads_the_prompt_and_follows_the_prefix(envoy: Envoy) -> None:
    """The cache-aware picker holds the request body to read its prompt (approximate
    tracking, from the text), hands it back whole (a body of several ext_proc chunks), and
    sends a prompt that shares a long prefix to the pair that served that prefix."""
    system = "".join(f"tenant-a rule {i}: answer in full sentences. " for i in range(4000))
    assert len(system) > 2 * BODY_CHUNK

    async def scenario(p: Pool) -> None:
        first = {**PROMPT, "prompt": system + "Q0?"}
        status, body, pair = await post(envoy.url, first)
        assert status == 200 and text_of(body) == pair, body
        prefill, decode = pair.split("->")
        for i in range(1, 7):
            question = {**PROMPT, "prompt": system + f"Q{i}?", "stream": i % 2 == 0}
            async with aiohttp.ClientSession() as s, s.post(
                    f"{envoy.url}/v1/completions", json=question) as r:
                assert r.status == 200, await r.text()
                assert r.headers[PAIR_HEADER] == pair, (i, r.headers[PAIR_HEADER])
                await r.read()
        # Every prompt reached both engines of the pair byte for byte.
        assert p.engines[prefill].prompts == [system + f"Q{i}?" for i in range(7)]
        assert p.engines[decode].prompts == p.engines[prefill].prompts
        # Each request's counts end when Envoy closes its ext_proc stream, just after the
        # client has the answer.
        picker = p.picker
        assert picker is not None
        for _ in range(200):
            if picker.balancer.outstanding == Counter():
                break
            await asyncio.sleep(0.05)
        assert picker.balancer.outstanding == Counter()
    run(scenario, chooser=ChooserSettings("cache-aware"))
