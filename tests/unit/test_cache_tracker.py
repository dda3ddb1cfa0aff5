"""The cache tracker's prompts under precise tracking, against an aiohttp server playing an
engine's ``/tokenize`` (one token per word): a prompt whose opening no earlier prompt had is
chosen without the round trip and tokenized after the choice, so that the next prompt that
shares it finds it expected at the engines it went to."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvbridge_router.affinity import CacheTracker, TrackingSettings
from kvbridge_router.balance import Balancer, ChooserSettings
from kvbridge_router.prefix import token_block_keys
from kvbridge_router.table import Engine, RoutingTable
from local_http import serve_locally

BS = 4
SYSTEM = " ".join(f"rule{i}" for i in range(40))          # 40 tokens: 10 blocks


def words_to_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50_000 for w in text.split()]


class Tokenizer:
    """``/tokenize`` as vLLM answers it, one token per word; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> Tokenizer:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        self.runner, self.port = await serve_locally(app)
        return self

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(body)
        return web.json_response({"tokens": words_to_ids(body["prompt"])})


def run(scenario: Callable[[Tokenizer, CacheTracker, RoutingTable, aiohttp.ClientSession],
                           Awaitable[None]]) -> None:  # fmt: skip
    async def main() -> None:
        server = await Tokenizer().start()
        engines = {eid: Engine(eid, role, "127.0.0.1", (eid,), server.port, BS, 1000, 64,
                               kv_events_port=5999)  # events stated: precise tracking
                   for eid, role in (("p0", "prefill"), ("d0", "decode"))}  # fmt: skip
        table = RoutingTable({"d0": ("p0",)}, engines)
        tracker = CacheTracker(Balancer(ChooserSettings("cache-aware")),
                               TrackingSettings(chars_per_token=4), lambda: table, 0)
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(server, tracker, table, session)
        finally:
            assert server.runner is not None
            await server.runner.cleanup()
    asyncio.run(main())


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_a_prompt_with_an_unseen_opening_is_tokenized_after_the_choice() -> None:
    async def scenario(server: Tokenizer, tracker: CacheTracker, table: RoutingTable,
                       session: aiohttp.ClientSession) -> None:  # fmt: skip
        index = tracker.balancer.index
        first = await tracker.prompt(session, {"prompt": f"{SYSTEM} q one", "model": "m"},
                                     table)  # fmt: skip
        assert first is not None and first.keys == () and server.calls == []
        assert first.deferred == {"prompt": f"{SYSTEM} q one", "model": "m"}
        assert first.blocks == -(-len(f"{SYSTEM} q one") // (BS * 4))
        decision = tracker.balancer.decide(table, prompt=first)
        assert decision is not None and decision.pair.prefill_blocks == first.blocks
        tracker.chosen(decision, first)                  # tokenized now, off the path
        keys = token_block_keys(words_to_ids(f"{SYSTEM} q one"), BS)
        await until(lambda: index.held("p0", keys) == len(keys))
        assert index.held("d0", keys) == len(keys) and len(server.calls) == 1

        second = await tracker.prompt(session, {"prompt": f"{SYSTEM} q two"}, table)
        assert second is not None and second.deferred is None and len(server.calls) == 2
        assert second.keys[:10] == tuple(keys[:10])      # the shared system prompt
        assert index.held("p0", second.keys) == 10       # expected where the first went

        by_ids = await tracker.prompt(session, {"prompt": words_to_ids("unseen words")}, table)
        assert by_ids is not None and by_ids.deferred is None and len(server.calls) == 2
    run(scenario)


def test_a_failed_deferred_tokenization_expects_nothing() -> None:
    async def scenario(server: Tokenizer, tracker: CacheTracker, table: RoutingTable,
                       session: aiohttp.ClientSession) -> None:  # fmt: skip
        cold = await tracker.prompt(session, {"prompt": f"{SYSTEM} q"}, table)
        assert cold is not None and cold.deferred is not None
        assert server.runner is not None
        await server.runner.cleanup()                    # the engine went away
        decision = tracker.balancer.decide(table, prompt=cold)
        assert decision is not None
        tracker.chosen(decision, cold)
        await until(lambda: not tracker._deferred)
        assert tracker.balancer.index.engines() == []
        assert tracker.balancer.index.held("p0", token_block_keys(
            words_to_ids(f"{SYSTEM} q"), BS)) == 0  # fmt: skip
    run(scenario)
