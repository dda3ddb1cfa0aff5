"""The router's drain (drain.py), in process, against engines that answer slowly (aiohttp
servers playing vLLM's P/D endpoints): readiness fails at once while liveness stays, requests
are still served for the delay with ``Connection: close``, the listener then closes, requests
in flight (streams, fanned-out streams, whole answers) finish within the grace, and those that
cannot are cut with an error, never a short answer that looks complete, and counted. The
process with a real SIGTERM: tests/integration/test_router_drain.py."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvbridge_router import metrics as m
from kvbridge_router.__main__ import _serve_http, parse_args
from kvbridge_router.drain import Drain, DrainSettings
from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.table import RoutingTable
from kvbridge_testkit.prometheus import counts_by_label
from local_http import SlowEngine


def run(scenario: Callable[..., Awaitable[Any]], settings: DrainSettings) -> Any:
    """An engine, a router with ``settings`` in front of it, and ``scenario(url, engine,
    drain, runner)``."""
    async def main() -> Any:
        engine = await SlowEngine().start()
        table = RoutingTable({"decode-0": ("prefill-0",)},
                             {"decode-0": engine.engine("decode"),
                              "prefill-0": engine.engine("prefill")})  # fmt: skip
        router = Router(lambda: table, RouterSettings())
        drain = Drain(settings)
        runner = await _serve_http(drain.install(router.app(), router.health), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            return await scenario(url, engine, drain, runner)
        finally:
            m.DRAINING.set(0)
            await runner.cleanup()
            assert engine.runner is not None
            await engine.runner.cleanup()
    return asyncio.run(main())


async def complete(url: str, prompt: str, stream: bool = False, **extra: Any
                   ) -> tuple[int, str, str]:  # fmt: skip
    """(status, body, Connection header) of one completion, on a connection of its own."""
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream, **extra}
    ) as r:  # fmt: skip
        return r.status, await r.text(), r.headers.get("Connection", "")


async def get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}{path}") as r:
        return r.status, r.headers.get("Connection", "")


async def until(predicate: Callable[[], bool], timeout: float = 5) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never met")


def events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def outcomes() -> Counter[str]:
    return counts_by_label(m.REQUESTS, "kvbridge_router_requests_total", "outcome")


def cuts() -> Counter[str]:
    return counts_by_label(m.DRAIN_CUTS, "kvbridge_router_drain_cut_requests_total", "stage")


def test_readiness_fails_at_once_and_requests_in_flight_finish() -> None:
    async def scenario(url: str, engine: SlowEngine, drain: Drain, runner: web.AppRunner
                       ) -> None:  # fmt: skip
        before, cut_before = outcomes(), cuts()
        assert await get(url, "/ready") == (200, "")
        in_flight = [asyncio.create_task(complete(url, "6 0.15", stream=True)),
                     asyncio.create_task(complete(url, "4 0.2", stream=True, n=2)),
                     asyncio.create_task(complete(url, "6 0.15"))]
        await until(lambda: engine.decodes == 4)
        shutting = asyncio.create_task(drain.shut_down(runner))
        await asyncio.sleep(0.05)
        assert m.DRAINING._value.get() == 1
        assert await get(url, "/ready") == (503, "close")
        assert await get(url, "/health") == (200, "close")      # liveness stays
        # Within the delay a new request is served, on a connection that then closes.
        status, text, connection = await complete(url, "2 0.01", stream=True)
        assert (status, connection) == (200, "close") and events(text)[-1] == "[DONE]"
        await asyncio.sleep(0.5)                                 # the delay is over
        with pytest.raises(aiohttp.ClientConnectionError):
            await complete(url, "1 0")
        streamed, fanned, whole = await asyncio.gather(*in_flight)
        assert streamed[0] == 200 and events(streamed[1])[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events(streamed[1])[:-1]) \
            == "w0 w1 w2 w3 w4 w5 "
        assert fanned[0] == 200 and events(fanned[1])[-1] == "[DONE]"
        assert len(events(fanned[1])) == 2 * 4 + 1 and "error" not in fanned[1]
        assert whole[0] == 200 and json.loads(whole[1])["choices"][0]["text"] == \
            "w0 w1 w2 w3 w4 w5 "
        assert await shutting == 0
        assert outcomes() - before == Counter(answered=4) and cuts() == cut_before
        assert engine.aborted == 0
    run(scenario, DrainSettings(delay_s=0.4, grace_s=10))


def test_requests_past_the_grace_are_cut_with_an_error_never_a_short_success() -> None:
    async def scenario(url: str, engine: SlowEngine, drain: Drain, runner: web.AppRunner
                       ) -> None:  # fmt: skip
        before, cut_before = outcomes(), cuts()
        in_flight = [asyncio.create_task(complete(url, "100 0.05", stream=True)),
                     asyncio.create_task(complete(url, "100 0.05", stream=True, n=2)),
                     asyncio.create_task(complete(url, "100 0.05"))]
        await until(lambda: engine.decodes == 4)
        await asyncio.sleep(0.2)            # the streams are under way
        assert await drain.shut_down(runner) == 3
        streamed, fanned, whole = await asyncio.gather(*in_flight)
        for status, text, _ in (streamed, fanned):
            assert status == 200
            *words, last = events(text)
            assert words and "[DONE]" not in events(text)
            error = json.loads(last)["error"]
            assert error["code"] == 503 and error["type"] == "service_unavailable"
            assert "drain grace of 0.3 s" in error["message"]
        status, text, connection = whole
        assert (status, connection) == (503, "close")
        assert json.loads(text)["error"]["type"] == "service_unavailable"
        assert outcomes() - before == Counter(shutdown=3)
        assert cuts() - cut_before == Counter(streaming=2, waiting=1)
        await until(lambda: engine.aborted == 4)     # every decode connection closed: aborts
    run(scenario, DrainSettings(delay_s=0.1, grace_s=0.3))


def test_a_second_signal_ends_the_drain_at_once() -> None:
    async def scenario(url: str, engine: SlowEngine, drain: Drain, runner: web.AppRunner
                       ) -> None:  # fmt: skip
        in_flight = asyncio.create_task(complete(url, "100 0.05", stream=True))
        await until(lambda: engine.decodes == 1)
        hurry = asyncio.Event()
        loop = asyncio.get_running_loop()
        began = loop.time()
        shutting = asyncio.create_task(drain.shut_down(runner, hurry))
        await asyncio.sleep(0.1)
        hurry.set()
        assert await shutting == 1 and loop.time() - began < 3
        status, text, _ = await in_flight
        assert status == 200 and "[DONE]" not in text and "error" in events(text)[-1]
    run(scenario, DrainSettings(delay_s=30, grace_s=30))


def test_drain_flags() -> None:
    args = parse_args(["--transfer", "t", "--drain-delay-seconds", "2",
                       "--drain-grace-seconds", "40"])  # fmt: skip
    assert args.drain == DrainSettings(2, 40)
    assert parse_args(["epp", "--transfer", "t"]).drain == DrainSettings()
    assert parse_args(["sidecar", "--transfer", "t", "--pod-name", "p",
                       "--drain-grace-seconds", "0"]).drain.grace_s == 0  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["--transfer", "t", "--drain-delay-seconds", "-1"])
