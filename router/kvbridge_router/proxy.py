"""The router's HTTP side (aiohttp): an OpenAI-compatible front for one KVTransfer's vLLM
engines, sending each request over a verified pair (table.py, balance.py) in vLLM's P/D
flow (flow.py), with the OpenAI surface of a vLLM engine as clients see it.

Threads and state: everything here runs on one asyncio loop. ``table()`` returns the latest
routing table, which the KVTransfer watch (watch.py) replaces from its own threads; each
request reads it once per attempt, so a pair the watch drops gets no new request after the
next read. The balancer's counts are touched only on the loop.

Failures: a prefill that fails, answers a 5xx or returns no ``kv_transfer_params``, or a
decode that fails before the client saw a byte (a stream's first chunk; a whole non-streaming
answer, sent in one piece), costs the request one retry on another pair; after the first byte
was sent to the client, a streaming answer ends with an error event and no ``[DONE]``, so no
client takes the cut answer for a whole one (the drain's cut ends the same way). A client
that goes away cancels its handler, which closes the decode connection: vLLM aborts the
request and, when it had not read the prompt's KV yet, tells the prefill to free the blocks
(vLLM's abort path), instead of holding them for the lease.

Client errors are the client's answer: a 4xx from the prefill or the decode passes through
with the engine's status and body, is counted ``rejected`` and is never retried (another pair
would only answer the same); a prefill's message about the prompt's length is said of the
client's own ``max_tokens`` (client_errors.py). Batched prompts and ``n`` > 1 fan out as
single P/D requests whose answers merge as vLLM merges them (batching.py). The body's size,
media type, nesting and reading time are bounded (limits.py), and so is the time a
connection takes to send its request line and headers (``header_timeout_s``). Every request
is counted once, however its handler ends (tally.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import logfilter, sse, tally
from . import metrics as m
from .affinity import CacheTracker
from .balance import Balancer, Pair, Prompt
from .batching import plan
from .client_errors import prefill_rejection
from .errors import EngineRejection, Refusal, UpstreamError
from .fanout import FanOut
from .flow import (
    CHAT,
    COMPLETIONS,
    RequestError,
    check_request,
    decode_request,
    fresh_enough,
    prefill_request,
    transfer_params,
)
from .limits import BodyError, read_json
from .settings import RouterSettings
from .table import Engine, RoutingTable
from .upstream import (
    JSON_CONTENT_TYPE,
    JSON_HEADERS,
    SSE,
    Answer,
    Upstream,
    decode_json,
    encode,
    error_response,
    stamp,
    stream_error,
)

#: Re-exported where callers have always found them.
__all__ = [
    "Answer",
    "EngineRejection",
    "Refusal",
    "Router",
    "RouterSettings",
    "Upstream",
    "UpstreamError",
    "error_response",
]

log = logging.getLogger("kvbridge.router")

ATTEMPTS = 2          # the first try and one retry on another pair
MAX_LEASE_REPREFILLS = 2


class Router(FanOut):
    """Request handling; ``app()`` wires it to routes."""

    #: where the latest routing table comes from (the KVTransfer watch)
    TableSource = Callable[[], RoutingTable]

    def __init__(self, table: TableSource, settings: RouterSettings) -> None:
        self.table = table
        self.settings = settings
        self.balancer = Balancer(settings.chooser)
        self.tracker = (CacheTracker(self.balancer, settings.tracking, table, settings.engine_port)
                        if settings.chooser.policy == "cache-aware" else None)  # fmt: skip
        self._tracking: asyncio.Task[None] | None = None
        self._stop_tracking = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self._outstanding: dict[tuple[str, str], Any] = {}  # gauge children, looked up once

    def app(self) -> web.Application:
        logfilter.install()
        app = web.Application(client_max_size=self.settings.max_body_bytes,
                              handler_args=self._handler_args())  # fmt: skip
        app.router.add_post(COMPLETIONS, self.generate)
        app.router.add_post(CHAT, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    def status_app(self) -> web.Application:
        """Only ``/health`` and ``/metrics``: what the endpoint picker serves over HTTP."""
        logfilter.install()
        app = web.Application(handler_args=self._handler_args())
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def _handler_args(self) -> dict[str, Any]:
        """aiohttp's per-connection settings; they override the runner's (``__main__``)."""
        return {"keepalive_timeout": self.settings.header_timeout_s}

    async def _open(self, _app: web.Application) -> None:
        # No total timeout: answers stream for as long as the decode generates.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0))
        if self.tracker is not None:
            self._tracking = asyncio.create_task(self.tracker.run(self.session,
                                                                  self._stop_tracking))

    async def _close(self, _app: web.Application) -> None:
        if self._tracking is not None:
            self._stop_tracking.set()
            await asyncio.gather(self._tracking, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def _url(self, engine: Engine, path: str) -> str:
        return f"http://{engine.host}:{engine.port or self.settings.engine_port}{path}"

    # -- small endpoints ---------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        table = self.table()
        if table.pairs:
            return web.json_response({"status": "ok", "verifiedPairs": table.pair_count()})
        return web.json_response({"status": "unavailable", "reason": table.reason}, status=503)

    async def metrics(self, _request: web.Request) -> web.Response:
        # The gauge follows the table the watch keeps; read at scrape time, never stale.
        m.VERIFIED_PAIRS.set(self.table().pair_count())
        return web.Response(body=generate_latest(m.REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, _request: web.Request) -> web.Response:
        table = self.table()
        decodes = table.decodes()
        if not decodes:
            return error_response(503, f"no verified prefill/decode pair: {table.reason}",
                                  "no_verified_pair")
        assert self.session is not None
        try:
            async with self.session.get(self._url(decodes[0], "/v1/models"),
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, f"decode {decodes[0].engine_id}: {exc}", "upstream_error")

    # -- completions -------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            with tally.opened():
                body = await self._read_body(request)
                if isinstance(body, web.StreamResponse):
                    return body
                return await self._serve(request, body, started)
        finally:
            m.TOTAL_SECONDS.observe(time.monotonic() - started)

    async def _read_body(self, request: web.Request) -> dict[str, Any] | web.StreamResponse:
        """The client's request body, checked; an error answer (counted) when it is bad."""
        try:
            body = await read_json(request, self.settings.max_body_bytes,
                                   self.settings.body_timeout_s)  # fmt: skip
            return check_request(request.path, body)
        except BodyError as exc:
            out = web.json_response(exc.body, status=exc.status)
            if exc.close:
                out.force_close()
            return self._count(out, "rejected")
        except RequestError as exc:
            return self._count(error_response(400, str(exc), "invalid_request_error"), "rejected")

    def _refuse(self, exc: Refusal) -> web.StreamResponse:
        return self._count(error_response(exc.status, str(exc), exc.kind), "rejected")

    def _count(self, response: web.StreamResponse, outcome: str, pair: Pair | None = None
               ) -> web.StreamResponse:  # fmt: skip
        """``response``, its request counted ``outcome``: on the handler's tally when one is
        open (counted when the handler ends), at once otherwise."""
        tally.record(outcome, pair)
        return stamp(response, pair)

    @staticmethod
    def _settle(outcome: str, pair: Pair | None) -> None:
        current = tally.current()
        if current is not None:
            current.settle(outcome, pair)

    async def _serve(self, request: web.Request, body: dict[str, Any], started: float
                     ) -> web.StreamResponse:  # fmt: skip
        try:
            fan = plan(request.path, body, self.settings.max_fanout)
        except RequestError as exc:
            return self._count(error_response(400, str(exc), "invalid_request_error"), "rejected")
        if len(fan.bodies) > 1:
            return await self._fan_out(request, fan, started)
        result = await self._pd(request, fan.bodies[0])
        if isinstance(result, Answer):
            return self._count(result.response(), result.outcome, result.pair)
        m.TTFT_SECONDS.observe(time.monotonic() - started)
        return await self._respond(request, result)

    async def _pd(self, request: web.Request, body: dict[str, Any]) -> Upstream | Answer:
        """One P/D request: the decode's answer, its first bytes received, over a pair tried
        again per the failure rules (module docstring); an Answer when none is left to relay.
        Counts nothing: the caller answers the client."""
        avoid: set[tuple[str, str]] = set()
        failures: list[str] = []
        attempts = reprefills = 0
        prompt = await self._prompt(body)
        while True:
            table = self.table()
            try:
                pair = self.choose(request, table, avoid, prompt)
            except Refusal as exc:
                return Answer.error(exc.status, str(exc), exc.kind, "rejected")
            if pair is None:
                if not failures:
                    return Answer.error(503, f"no verified prefill/decode pair: {table.reason}",
                                        "no_verified_pair", "no_pair")  # fmt: skip
                return Answer.error(502, "; ".join(failures), "upstream_error", "failed")
            attempts += 1
            try:
                return await self._attempt(request.path, body, pair)
            except EngineRejection as exc:
                return Answer(exc.status, exc.body, "rejected", pair, exc.content_type)
            except UpstreamError as exc:
                failures.append(f"{pair.label}: {exc}")
                log.warning("request failed on pair %s at %s: %s", pair.label, exc.stage, exc)
                if exc.stage == "lease" and reprefills < MAX_LEASE_REPREFILLS:
                    reprefills += 1
                    attempts -= 1
                    m.RETRIES.labels("lease").inc()
                    continue
                avoid.add((pair.decode.engine_id, pair.prefill.engine_id))
                if attempts >= ATTEMPTS:
                    return Answer.error(502, "; ".join(failures), "upstream_error", "failed",
                                        pair)  # fmt: skip
                m.RETRIES.labels(exc.stage).inc()

    async def _prompt(self, body: dict[str, Any]) -> Prompt | None:
        """The request's prompt as blocks, for the cache-aware policy (None under least-load)."""
        if self.tracker is None or self.session is None:
            return None
        return await self.tracker.prompt(self.session, body, self.table())

    def choose(self, request: web.Request, table: RoutingTable,
               avoid: Collection[tuple[str, str]], prompt: Prompt | None = None
               ) -> Pair | None:  # fmt: skip
        """The pair for the next attempt (balance.py); None when no pair is left. Fronts
        that take the pair from the request (the sidecar) override this."""
        decision = self.balancer.decide(table, avoid, prompt=prompt)
        if decision is None:
            return None
        if self.tracker is not None:
            self.tracker.chosen(decision, prompt)
        return decision.pair

    async def _attempt(self, path: str, body: dict[str, Any], pair: Pair) -> Upstream:
        self._start(pair.decode)    # from the pick on: concurrent picks see it taken
        try:
            params, answered_at = await self._prefill(path, body, pair.prefill,
                                                      pair.prefill_blocks)  # fmt: skip
            if not fresh_enough(answered_at, time.monotonic(), self.settings.lease_s,
                                self.settings.lease_margin_s):
                raise UpstreamError("lease", "the prefill's answer is older than its lease "
                                    f"minus {self.settings.lease_margin_s:g} s")
            upstream = await self._open_decode(path, decode_request(body, params), pair)
        except BaseException:
            self._done(pair.decode)
            raise
        upstream.on_close(lambda: self._done(pair.decode))
        return upstream

    async def _prefill(self, path: str, body: dict[str, Any], engine: Engine, blocks: int = 0
                       ) -> tuple[dict[str, Any], float]:  # fmt: skip
        """The prefill's ``kv_transfer_params`` and when they came; ``blocks``: the prompt
        blocks it was chosen to compute (its work while the call lasts)."""
        assert self.session is not None
        self._start(engine, blocks)
        began = time.monotonic()
        try:
            async with self.session.post(
                    self._url(engine, path), data=encode(prefill_request(path, body)),
                    headers=JSON_HEADERS,
                    timeout=aiohttp.ClientTimeout(total=self.settings.prefill_timeout_s)
            ) as resp:
                raw = await resp.read()
                if 400 <= resp.status < 500:
                    raise EngineRejection(resp.status, prefill_rejection(path, body, raw),
                                          resp.headers.get("Content-Type", JSON_CONTENT_TYPE))
                if resp.status != 200:
                    raise UpstreamError("prefill", f"prefill answered HTTP {resp.status}: "
                                        f"{raw[:300].decode(errors='replace')}")
                params = transfer_params(decode_json(raw))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamError("prefill", f"prefill {engine.engine_id}: "
                                f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._done(engine, blocks)
        m.PREFILL_SECONDS.observe(time.monotonic() - began)
        return params, time.monotonic()

    async def _open_decode(self, path: str, body: dict[str, Any], pair: Pair) -> Upstream:
        """The decode's answer to ``body`` up to its first bytes (all of a whole answer, and
        of a 4xx); UpstreamError when it fails before then."""
        assert self.session is not None
        engine = pair.decode
        began = time.monotonic()
        try:
            resp = await self.session.post(
                self._url(engine, path), data=encode(body), headers=JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.settings.decode_connect_timeout_s))
        except (aiohttp.ClientError, TimeoutError) as exc:
            m.DECODE_SECONDS.observe(time.monotonic() - began)
            raise UpstreamError("decode", f"decode {engine.engine_id}: "
                                f"{type(exc).__name__}: {exc}") from exc
        streaming = resp.content_type == SSE and resp.status < 400
        try:
            first = await self._decode_bytes(resp, engine,
                                             resp.content.readany if streaming else resp.read)
        except BaseException:
            resp.release()
            m.DECODE_SECONDS.observe(time.monotonic() - began)
            raise
        return Upstream(resp, first, pair, began, streaming)

    async def _decode(self, request: web.Request, body: dict[str, Any], pair: Pair,
                      started: float) -> web.StreamResponse:  # fmt: skip
        """The decode's answer to ``body`` relayed to the client and counted (the sidecar's
        local path calls this with its engine as both ends of ``pair``); UpstreamError,
        uncounted, when the decode fails before the client saw a byte."""
        with tally.opened(drop_on=UpstreamError):
            upstream = await self._open_decode(request.path, body, pair)
            m.TTFT_SECONDS.observe(time.monotonic() - started)
            return await self._respond(request, upstream)

    async def _respond(self, request: web.Request, upstream: Upstream) -> web.StreamResponse:
        """One decode's answer to the client: a whole one in one piece, a stream as it
        arrives; 4xx answers pass through."""
        try:
            if upstream.streaming:
                return await self._relay(request, upstream)
            out = web.Response(status=upstream.status, body=upstream.first,
                               headers={"Content-Type": upstream.content_type})  # fmt: skip
            return self._count(out, "answered" if upstream.status < 400 else "rejected",
                               upstream.pair)  # fmt: skip
        finally:
            upstream.close()

    @staticmethod
    async def _decode_bytes(resp: aiohttp.ClientResponse, engine: Engine,
                            read: Callable[[], Awaitable[bytes]]) -> bytes:  # fmt: skip
        """The decode's first bytes (``read``: its first chunk, or its whole answer); a
        connection error, a 5xx or nothing at all is an :class:`UpstreamError` (retried)."""
        try:
            data = await read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError("decode", f"decode {engine.engine_id}: "
                                f"{type(exc).__name__}: {exc}") from exc
        if resp.status >= 500 or (not data and resp.status < 400):
            raise UpstreamError("decode", f"decode answered HTTP {resp.status}: "
                                f"{data[:300].decode(errors='replace')}")
        return data

    async def _relay(self, request: web.Request, upstream: Upstream) -> web.StreamResponse:
        """The decode's stream to the client as it arrives. Answered once its ``[DONE]``
        went out, so a client that closes right after still counts as answered; a failure
        after the first byte ends the stream with an error event."""
        pair = upstream.pair
        out = web.StreamResponse(status=upstream.status)
        out.content_type = upstream.resp.content_type
        stamp(out, pair)
        self._settle(tally.CANCELLED, pair)
        await out.prepare(request)
        await out.write(upstream.first)
        tail = upstream.first[-32:]
        done = sse.ends_with_done(tail)
        if done:
            self._settle("answered", pair)
        outcome = "answered"
        try:
            async for chunk in upstream.rest():
                await out.write(chunk)
                tail = (tail + chunk)[-32:]
                if not done and sse.ends_with_done(tail):
                    done = True
                    self._settle("answered", pair)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not done:
                log.warning("decode %s failed mid-answer: %s", pair.decode.engine_id, exc)
                separator = b"" if tail.endswith(b"\n\n") else b"\n\n"
                await out.write(separator + stream_error(pair, exc))
                outcome = "stream_error"
        self._settle(outcome, pair)
        await out.write_eof()
        return out

    def _gauge(self, engine: Engine) -> Any:
        key = (engine.engine_id, engine.role)
        gauge = self._outstanding.get(key)
        if gauge is None:
            gauge = self._outstanding[key] = m.OUTSTANDING.labels(*key)
        return gauge

    def _start(self, engine: Engine, blocks: int = 0) -> None:
        self.balancer.start(engine, blocks)
        self._gauge(engine).inc()

    def _done(self, engine: Engine, blocks: int = 0) -> None:
        self.balancer.done(engine, blocks)
        self._gauge(engine).dec()
