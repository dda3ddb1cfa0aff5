"""Batched prompts and ``n`` > 1 (batching.py): one request fanned out as single P/D
requests, started together, whose answers merge as vLLM merges them. A part of
:class:`~.proxy.Router` (a mixin), apart because it is its own flow."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from . import metrics as m
from . import sse, tally
from .balance import Pair
from .batching import Plan, StreamMerge, merge_answers
from .upstream import (
    JSON_HEADERS,
    SSE,
    Answer,
    Upstream,
    close_all,
    decode_json,
    encode,
    error_response,
    stamp,
    stream_error,
)

__all__ = ["MERGE_QUEUE", "FanOut"]

log = logging.getLogger("kvbridge.router")

#: events of a fanned-out stream read ahead of the client (beyond, the decodes wait)
MERGE_QUEUE = 64


class FanOut:
    """The router's fan-out; the router supplies one P/D request (``_pd``) and the tally."""

    if TYPE_CHECKING:
        async def _pd(self, request: web.Request, body: dict[str, Any]) -> Upstream | Answer:
            ...

        def _count(self, response: web.StreamResponse, outcome: str, pair: Pair | None = None
                   ) -> web.StreamResponse:  # fmt: skip
            ...

        @staticmethod
        def _settle(outcome: str, pair: Pair | None) -> None:
            ...

    async def _fan_out(self, request: web.Request, fan: Plan, started: float
                       ) -> web.StreamResponse:  # fmt: skip
        begun = await self._start_all(request, fan)
        if isinstance(begun, Answer):
            return self._count(begun.response(), begun.outcome, begun.pair)
        m.TTFT_SECONDS.observe(time.monotonic() - started)
        pair = begun[0].pair
        try:
            if all(u.streaming for u in begun):
                return await self._relay_merged(request, fan, begun)
            try:
                answers = [] if any(u.streaming for u in begun) else \
                    [decode_json(u.first) for u in begun]
            except msgspec.DecodeError:
                answers = []
            if not answers or not all(isinstance(a, dict) for a in answers):
                return self._count(error_response(
                    502, "the decodes' answers to a fanned-out request do not merge",
                    "upstream_error"), "failed", pair)
            return self._count(web.Response(body=encode(merge_answers(fan, answers)),
                                            headers=JSON_HEADERS), "answered", pair)
        finally:
            for upstream in begun:
                upstream.close()

    async def _start_all(self, request: web.Request, fan: Plan) -> list[Upstream] | Answer:
        """Every P/D request of ``fan`` up to its decode's first bytes (vLLM, too, checks all
        the prompts of a batch before it answers a byte), or the one answer for them all: the
        first prompt's rejection, as vLLM gives it, else the first failure. Requests after a
        rejected one are cancelled at once: they cannot change the answer."""
        tasks = [asyncio.create_task(self._pd(request, body)) for body in fan.bodies]
        index = {task: i for i, task in enumerate(tasks)}
        results: dict[int, Upstream | Answer] = {}
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled():
                        result = task.result()
                        rejection = result.rejection() if isinstance(result, Upstream) else None
                        results[index[task]] = rejection or result
                first = min((i for i, r in results.items()
                             if isinstance(r, Answer) and r.outcome == "rejected"), default=None)
                for task in pending:
                    if first is not None and index[task] > first:
                        task.cancel()
        except BaseException:
            for task in tasks:
                task.cancel()
            finished = await asyncio.gather(*tasks, return_exceptions=True)
            close_all([*results.values(), *finished])
            raise
        ended = sorted((r.outcome != "rejected", i) for i, r in results.items()
                       if isinstance(r, Answer))  # fmt: skip
        if ended:
            close_all(results.values())
            answer = results[ended[0][1]]
            assert isinstance(answer, Answer)
            return answer
        return [u for _, u in sorted(results.items()) if isinstance(u, Upstream)]

    async def _relay_merged(self, request: web.Request, fan: Plan, upstreams: list[Upstream]
                            ) -> web.StreamResponse:  # fmt: skip
        """The decodes' streams as one (batching.StreamMerge), events as they arrive."""
        pair = upstreams[0].pair
        merge = StreamMerge(fan)
        out = web.StreamResponse(status=200)
        out.content_type = SSE
        stamp(out, pair)
        self._settle(tally.CANCELLED, pair)
        await out.prepare(request)
        queue: asyncio.Queue[tuple[int, sse.Event | Exception | None]] = \
            asyncio.Queue(maxsize=MERGE_QUEUE)
        pumps = [asyncio.create_task(_pump(i, u, queue)) for i, u in enumerate(upstreams)]
        outcome = "answered"
        try:
            live = len(pumps)
            while live:
                sub, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    failed = upstreams[sub].pair
                    log.warning("decode %s failed mid-answer: %s", failed.decode.engine_id, item)
                    await out.write(stream_error(failed, item))
                    outcome = "stream_error"
                    break
                else:
                    for data in merge.feed(sub, item):
                        await out.write(data)
                    if merge.failed:
                        outcome = "stream_error"
                        break
            if outcome == "answered":   # a failed stream ends with its error, no [DONE]
                await out.write(merge.finish())
            self._settle(outcome, pair)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        await out.write_eof()
        return out


async def _pump(sub: int, upstream: Upstream,
                queue: asyncio.Queue[tuple[int, sse.Event | Exception | None]]) -> None:
    """Sub-stream ``sub``'s events into ``queue``, then None; its failure before its
    ``[DONE]`` as the exception."""
    parser = sse.Parser()
    done = False
    try:
        for ev in parser.feed(upstream.first):
            done = done or ev.data == sse.DONE
            await queue.put((sub, ev))
        async for chunk in upstream.rest():
            for ev in parser.feed(chunk):
                done = done or ev.data == sse.DONE
                await queue.put((sub, ev))
        rest = parser.rest()
        if rest is not None:
            await queue.put((sub, rest))
    except (aiohttp.ClientError, TimeoutError) as exc:
        if not done:
            await queue.put((sub, exc))
            return
    await queue.put((sub, None))
