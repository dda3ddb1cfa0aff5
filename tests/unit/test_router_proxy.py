"""The router's failure handling, against engines that fail on purpose (aiohttp servers
playing vLLM's P/D endpoints; the real engines are in tests/node/test_serving_vllm.py): a
failed prefill or a decode that fails before its first byte is retried once on another pair,
a decode that fails mid-stream ends the stream with an error event, no verified pair is a 503
with the reason, and a bad request is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.table import Engine, RoutingTable


class FakeEngine:
    """One engine on 127.0.0.1; ``mode`` decides how it answers: ok, error (HTTP 500),
    drop (closes the connection before answering), midstream (streams a chunk, then drops) or
    partial (a non-streaming answer: its headers and part of its body, then drops)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode, self.calls = name, mode, 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        params = body["kv_transfer_params"]
        if self.mode == "error":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.1)
            return web.Response()
        if params.get("do_remote_decode"):       # the prefill step
            assert body["max_tokens"] == 1 and body["stream"] is False
            return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": self.name}})
        text = f"{params['remote_engine_id']}->{self.name}"
        if self.mode == "partial" and not body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "application/json",
                                              "Content-Length": "1000"})
            await out.prepare(request)
            await out.write(b'{"choices": [{"text": "')
            assert request.transport is not None
            request.transport.close()
            return out
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": text}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
        if self.mode == "midstream":
            assert request.transport is not None
            request.transport.close()
            return out
        await out.write(b"data: [DONE]\n\n")
        return out

    def engine(self, role: str) -> Engine:
        return Engine(self.name, role, "127.0.0.1", (self.name,), port=self.port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def run(scenario: Callable[..., Any], **modes: str) -> Any:
    """Start fake engines named by ``modes`` (p*: prefills, d*: decodes, every decode paired
    with every prefill), a router in front of them, and run ``scenario(url, engines)``."""
    async def main() -> Any:
        engines = {n: await FakeEngine(n, mode).start() for n, mode in modes.items()}
        ports = {e.port for e in engines.values()}
        assert len(ports) == len(engines)
        table = RoutingTable(
            {d: tuple(p for p in engines if p.startswith("p")) for d in engines
             if d.startswith("d")},
            {n: e.engine("prefill" if n.startswith("p") else "decode") for n, e in engines.items()},
            reason="" if engines else "nothing")  # fmt: skip
        router = Router(lambda: table, RouterSettings())
        runner = web.AppRunner(router.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await scenario(f"http://127.0.0.1:{port}", engines)
        finally:
            await runner.cleanup()
            for e in engines.values():
                await e.stop()
    return asyncio.run(main())


async def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.text()


PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 4}


def test_answers_over_the_pair_and_retries_a_failed_prefill_elsewhere() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(4):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p1->d0"
        assert engines["p0"].calls >= 1 and engines["p1"].calls == 4
    run(scenario, p0="error", p1="ok", d0="ok")


def test_decode_failure_before_the_first_byte_is_retried_on_another_pair() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(3):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p0->d1"
        assert engines["d0"].calls >= 1
    run(scenario, p0="ok", d0="drop", d1="ok")


def test_a_whole_answer_cut_short_is_retried_on_another_pair() -> None:
    """A non-streaming answer goes to the client in one piece, so a decode that fails in
    the middle of it has sent the client nothing yet: the request is retried, not broken."""
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(3):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p0->d1"
        assert engines["d0"].calls >= 1
    run(scenario, p0="ok", d0="partial", d1="ok")


def test_every_pair_failing_is_a_502_naming_the_attempts() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, PROMPT)
        assert status == 502
        message = json.loads(text)["error"]["message"]
        assert "p0->d0" in message and "p0->d1" in message
        assert engines["d0"].calls + engines["d1"].calls == 2    # one try and one retry
    run(scenario, p0="ok", d0="error", d1="error")


def test_mid_stream_failure_ends_the_stream_with_an_error_event() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, {**PROMPT, "stream": True})
        assert status == 200
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert events[0]["choices"][0]["text"] == "p0->d0"
        assert events[-1]["error"]["type"] == "upstream_error"
    run(scenario, p0="ok", d0="midstream")


def test_no_verified_pair_and_bad_requests() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, PROMPT)
        assert status == 503 and "no verified prefill/decode pair: nothing" in text
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            assert r.status == 503 and (await r.json())["reason"] == "nothing"
        status, text = await post(url, {**PROMPT, "prompt": ["a", "b"]})
        assert status == 400 and "prompt: expected one prompt" in text
        status, text = await post(url, {**PROMPT, "kv_transfer_params": {}})
        assert status == 400 and "kv_transfer_params" in text
    run(scenario)
