"""An aiohttp application served on a free loopback port: the small servers that play an
engine's endpoints in the router's tests; and one of them, an engine that answers slowly."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from kvbridge_router.table import Engine


async def serve_locally(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` listening on 127.0.0.1 at a port the kernel chose; its runner and that port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


class SlowEngine:
    """A prefill and a decode in one server: the decode answers ``pieces`` pieces (the
    prompt's first word), ``gap`` seconds apart (its second), streamed or whole."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.decodes = 0
        self.aborted = 0        # decode connections the router closed mid-answer

    async def start(self) -> SlowEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner, self.port = await serve_locally(app)
        return self

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["kv_transfer_params"].get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": "e"}})
        self.decodes += 1
        pieces, gap = body["prompt"].split()
        words = [f"w{i} " for i in range(int(pieces))]
        if not body.get("stream"):
            for _ in words:
                await asyncio.sleep(float(gap))
                if request.transport is None or request.transport.is_closing():
                    self.aborted += 1
                    return web.Response()
            return web.json_response({"choices": [{"index": 0, "text": "".join(words)}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for word in words:
                await out.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
                                .encode())  # fmt: skip
                await asyncio.sleep(float(gap))
            await out.write(b"data: [DONE]\n\n")
        except ConnectionError:
            self.aborted += 1
        return out

    def engine(self, role: str) -> Engine:
        return Engine(f"{role}-0", role, "127.0.0.1", (f"{role}-pod",), port=self.port)
