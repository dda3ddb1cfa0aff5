"""An aiohttp application served on a free loopback port: the small servers that play an
engine's endpoints in the router's tests."""

from __future__ import annotations

from aiohttp import web


async def serve_locally(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` listening on 127.0.0.1 at a port the kernel chose; its runner and that port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
