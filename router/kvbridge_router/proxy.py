"""The router's HTTP side (aiohttp): an OpenAI-compatible front for one KVTransfer's vLLM
engines, sending each request over a verified pair (table.py, balance.py) in vLLM's P/D
flow (flow.py).

Threads and state: everything here runs on one asyncio loop. ``table()`` returns the latest
routing table, which the KVTransfer watch (watch.py) replaces from its own threads; each
request reads it once per attempt, so a pair the watch drops gets no new request after the
next read. The balancer's counts are touched only on the loop.

Failures: a prefill that fails, answers an error or returns no ``kv_transfer_params``, or a
decode that fails before the client saw a byte (a stream's first chunk; a whole non-streaming
answer, sent in one piece), costs the request one retry on another pair; after the first byte
was sent to the client, a streaming answer ends with an error event. A client
that goes away cancels its handler, which closes the decode connection: vLLM aborts the
request and, when it had not read the prompt's KV yet, tells the prefill to free the blocks
(vLLM's abort path), instead of holding them for the lease.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import metrics as m
from .balance import Balancer, Pair
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
from .table import Engine, RoutingTable

log = logging.getLogger("kvbridge.router")

ATTEMPTS = 2          # the first try and one retry on another pair
MAX_LEASE_REPREFILLS = 2
SSE = "text/event-stream"
JSON_HEADERS = {"Content-Type": "application/json"}
_encode = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class RouterSettings:
    engine_port: int = 8000
    #: the prefills' kv_lease_duration (vLLM's default) and the part of it kept in reserve
    lease_s: float = 30.0
    lease_margin_s: float = 5.0
    prefill_timeout_s: float = 300.0
    #: connecting to a decode and receiving its response headers
    decode_connect_timeout_s: float = 30.0


class Refusal(Exception):
    """The request cannot be served as asked (the sidecar's prefill header names no verified
    peer, say): answered with ``status`` and the message, never retried."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class UpstreamError(Exception):
    """A prefill or decode failed before the client saw a byte; retried on another pair."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)  # fmt: skip


class Router:
    """Request handling; ``app()`` wires it to routes."""

    #: where the latest routing table comes from (the KVTransfer watch)
    TableSource = Callable[[], RoutingTable]

    def __init__(self, table: TableSource, settings: RouterSettings) -> None:
        self.table = table
        self.settings = settings
        self.balancer = Balancer()
        self.session: aiohttp.ClientSession | None = None
        self._outstanding: dict[tuple[str, str], Any] = {}  # gauge children, looked up once

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
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
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def _open(self, _app: web.Application) -> None:
        # No total timeout: answers stream for as long as the decode generates.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0))

    async def _close(self, _app: web.Application) -> None:
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
        body = await self._read_body(request)
        if isinstance(body, web.StreamResponse):
            return body
        try:
            return await self._serve(request, body, started)
        finally:
            m.TOTAL_SECONDS.observe(time.monotonic() - started)

    async def _read_body(self, request: web.Request) -> dict[str, Any] | web.StreamResponse:
        """The client's request body, checked; an error answer (counted) when it is bad."""
        try:
            return check_request(request.path, _decode_json(await request.read()))
        except msgspec.DecodeError:
            return self._count(error_response(400, "request body: expected JSON",
                                              "invalid_request_error"), "rejected")
        except RequestError as exc:
            return self._count(error_response(400, str(exc), "invalid_request_error"), "rejected")

    def _refuse(self, exc: Refusal) -> web.StreamResponse:
        return self._count(error_response(exc.status, str(exc), exc.kind), "rejected")

    def _count(self, response: web.StreamResponse, outcome: str, pair: Pair | None = None
               ) -> web.StreamResponse:  # fmt: skip
        prefill, decode = (pair.prefill.engine_id, pair.decode.engine_id) if pair else ("", "")
        m.REQUESTS.labels(outcome, prefill, decode).inc()
        return response

    async def _serve(self, request: web.Request, body: dict[str, Any], started: float
                     ) -> web.StreamResponse:  # fmt: skip
        avoid: set[tuple[str, str]] = set()
        failures: list[str] = []
        attempts = reprefills = 0
        while True:
            table = self.table()
            try:
                pair = self.choose(request, table, avoid)
            except Refusal as exc:
                return self._refuse(exc)
            if pair is None:
                if not failures:
                    return self._count(error_response(
                        503, f"no verified prefill/decode pair: {table.reason}",
                        "no_verified_pair"), "no_pair")
                return self._count(error_response(502, "; ".join(failures), "upstream_error"),
                                   "failed")
            attempts += 1
            try:
                return await self._attempt(request, body, pair, started)
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
                    return self._count(error_response(502, "; ".join(failures), "upstream_error"),
                                       "failed", pair)  # fmt: skip
                m.RETRIES.labels(exc.stage).inc()

    def choose(self, request: web.Request, table: RoutingTable,
               avoid: Collection[tuple[str, str]]) -> Pair | None:
        """The pair for the next attempt (balance.py); None when no pair is left. Fronts
        that take the pair from the request (the sidecar) override this."""
        return self.balancer.pick(table, avoid)

    async def _attempt(self, request: web.Request, body: dict[str, Any], pair: Pair,
                       started: float) -> web.StreamResponse:  # fmt: skip
        self._start(pair.decode)    # from the pick on: concurrent picks see it taken
        try:
            params, answered_at = await self._prefill(request.path, body, pair.prefill)
            if not fresh_enough(answered_at, time.monotonic(), self.settings.lease_s,
                                self.settings.lease_margin_s):
                raise UpstreamError("lease", "the prefill's answer is older than its lease "
                                    f"minus {self.settings.lease_margin_s:g} s")
            return await self._decode(request, decode_request(body, params), pair, started)
        finally:
            self._done(pair.decode)

    async def _prefill(self, path: str, body: dict[str, Any], engine: Engine
                       ) -> tuple[dict[str, Any], float]:  # fmt: skip
        assert self.session is not None
        self._start(engine)
        began = time.monotonic()
        try:
            async with self.session.post(
                    self._url(engine, path), data=_encode(prefill_request(path, body)),
                    headers=JSON_HEADERS,
                    timeout=aiohttp.ClientTimeout(total=self.settings.prefill_timeout_s)
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise UpstreamError("prefill", f"prefill answered HTTP {resp.status}: "
                                        f"{raw[:300].decode(errors='replace')}")
                params = transfer_params(_decode_json(raw))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamError("prefill", f"prefill {engine.engine_id}: "
                                f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._done(engine)
        m.PREFILL_SECONDS.observe(time.monotonic() - began)
        return params, time.monotonic()

    async def _decode(self, request: web.Request, body: dict[str, Any], pair: Pair,
                      started: float) -> web.StreamResponse:  # fmt: skip
        assert self.session is not None
        engine = pair.decode
        began = time.monotonic()
        try:
            try:
                resp = await self.session.post(
                    self._url(engine, request.path), data=_encode(body), headers=JSON_HEADERS,
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=self.settings.decode_connect_timeout_s))
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise UpstreamError("decode", f"decode {engine.engine_id}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            try:
                if resp.content_type != SSE:
                    return await self._answer(resp, pair, started)
                first = await self._decode_bytes(resp, engine, resp.content.readany)
                m.TTFT_SECONDS.observe(time.monotonic() - started)
                return await self._relay(request, resp, first, pair)
            finally:
                resp.release()
        finally:
            m.DECODE_SECONDS.observe(time.monotonic() - began)

    async def _answer(self, resp: aiohttp.ClientResponse, pair: Pair, started: float
                      ) -> web.Response:  # fmt: skip
        """A whole (non-streaming) answer, sent in one piece; until it is complete nothing
        reached the client, so a decode failing before then costs a retry, not an error."""
        raw = await self._decode_bytes(resp, pair.decode, resp.read)
        m.TTFT_SECONDS.observe(time.monotonic() - started)
        out = web.Response(status=resp.status, body=raw,
                           headers={"Content-Type": resp.headers.get("Content-Type", "")})
        return self._count(out, "answered" if resp.status < 400 else "rejected", pair)

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
        if resp.status >= 500 or not data:
            raise UpstreamError("decode", f"decode answered HTTP {resp.status}: "
                                f"{data[:300].decode(errors='replace')}")
        return data

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, first: bytes,
                     pair: Pair) -> web.StreamResponse:  # fmt: skip
        """The decode's answer to the client as it arrives; 4xx answers pass through."""
        outcome = "answered" if resp.status < 400 else "rejected"
        out = web.StreamResponse(status=resp.status)
        out.content_type = resp.content_type
        await out.prepare(request)
        await out.write(first)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("decode %s failed mid-answer: %s", pair.decode.engine_id, exc)
            if resp.content_type == SSE:
                event = {"error": {"message": f"decode {pair.decode.engine_id} failed after "
                                   f"the first byte: {type(exc).__name__}: {exc}",
                                   "type": "upstream_error", "code": 502}}
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
            outcome = "stream_error"
        await out.write_eof()
        return self._count(out, outcome, pair)

    def _gauge(self, engine: Engine) -> Any:
        key = (engine.engine_id, engine.role)
        gauge = self._outstanding.get(key)
        if gauge is None:
            gauge = self._outstanding[key] = m.OUTSTANDING.labels(*key)
        return gauge

    def _start(self, engine: Engine) -> None:
        self.balancer.start(engine)
        self._gauge(engine).inc()

    def _done(self, engine: Engine) -> None:
        self.balancer.done(engine)
        self._gauge(engine).dec()
