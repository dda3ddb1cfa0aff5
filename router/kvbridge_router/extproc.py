"""The endpoint picker as Envoy's ext_proc gRPC service: one stream per request, as an
inference gateway's Envoy opens it for an InferencePool.

Processing mode (what the inference extension configures): request headers SEND, request
body and response body FULL_DUPLEX_STREAMED, response headers SEND, trailers SEND. Under the
least-load policy the pick needs only the request headers (and their metadata: the subset
hint), so it is answered at once and the body is never buffered: every body chunk goes
straight back to Envoy, in order, with its end-of-stream flag, which keeps the picker off the
time to first token and streams SSE answers chunk by chunk. The cache-aware policy needs the
prompt: the request body is held until its end (up to ``MAX_HELD_BODY``; past it the pick is
made on load alone), then the headers are answered and the body returned in chunks, as the
inference extension's own picker does. Response bodies always stream. The response headers
get ``x-kvbridge-pair`` (the pair that served) and ``x-kvbridge-revision`` (its model
revision). The engines the stream named count as busy
(for the choice) until the response ends or the stream closes.

gRPC health: ``liveness`` always SERVING; ``readiness`` and the ext_proc service SERVING once
the KVTransfer and its KVEndpoints are listed (a pool with no verified pair is still ready:
its requests get a 503 that says why).

Draining (``serve_grpc`` with ``drain``; the router's rules, drain.py): from SIGTERM readiness
and the ext_proc service are NOT_SERVING (liveness stays SERVING) while new streams are still
served for the drain delay; then the server stops (no new streams; GOAWAY, so the gateway
opens its next streams elsewhere) and the open streams, each one request whose response may
still be streaming through, get the drain grace. A stream still open then is cancelled, which
the gateway (FailClose) turns into a failed request: a 500 before the response started, a
reset stream after; never a shortened answer that ends cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import metrics as m
from .affinity import CacheTracker, TrackingSettings
from .balance import REVISION_HEADER, Balancer, ChooserSettings, Pair, Prompt
from .drain import CUT_WAIT_S, DrainSettings, pause, settle
from .picker import (
    LB_NAMESPACE,
    PAIR_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    NoPick,
    PickerSettings,
    pick,
)
from .table import RoutingTable

log = logging.getLogger("kvbridge.picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
#: the most request body the cache-aware pick holds back to read the prompt
MAX_HELD_BODY = 16 * 2**20
#: body chunks handed back to Envoy after a held body (the inference extension's size)
BODY_CHUNK = 62_000


def _set_headers(headers: tuple[tuple[str, str], ...] | list[tuple[str, str]]
                 ) -> ep.HeaderMutation:  # fmt: skip
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=OVERWRITE) for k, v in headers])


def _echo(body: ep.HttpBody) -> ep.BodyResponse:
    """A body chunk handed back unchanged (full-duplex streaming returns every chunk)."""
    return _chunk(body.body, body.end_of_stream)


def _chunk(data: bytes, end_of_stream: bool) -> ep.BodyResponse:
    return ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=data, end_of_stream=end_of_stream))))


def _held_body(data: bytes, end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """A held request body handed back in chunks, the last one with its end-of-stream flag."""
    parts = [data[i:i + BODY_CHUNK] for i in range(0, len(data), BODY_CHUNK)] or [b""]
    return [ep.ProcessingResponse(request_body=_chunk(part, end_of_stream and i == len(parts) - 1))
            for i, part in enumerate(parts)]


def subset_hint(request: ep.ProcessingRequest) -> list[str] | None:
    """The gateway's endpoint subset (``ip:port`` strings), None when it sent none."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    field = meta[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if field is None:
        return None
    if field.HasField("list_value"):
        return [v.string_value for v in field.list_value.values]
    return [s for s in field.string_value.split(",") if s]


def _unavailable(status: int, message: str) -> ep.ProcessingResponse:
    body = json.dumps({"error": {"message": message, "type": "no_verified_pair",
                                 "code": status}}).encode()  # fmt: skip
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=_set_headers([("content-type", "application/json")]),
        details="kvbridge_no_verified_pair"))


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    """ext_proc ``Process``: pick on the request headers (cache-aware: on the whole request
    body), pass bodies through."""

    def __init__(self, table: Callable[[], RoutingTable], settings: PickerSettings,
                 chooser: ChooserSettings | None = None,
                 tracking: TrackingSettings | None = None) -> None:  # fmt: skip
        self.table = table
        self.settings = settings
        self.balancer = Balancer(chooser or ChooserSettings())
        self.tracker = (CacheTracker(self.balancer, tracking or TrackingSettings(), table,
                                     settings.engine_port)
                        if self.balancer.settings.policy == "cache-aware" else None)  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._tracking: asyncio.Task[None] | None = None
        self._last_refusal = ""
        #: from SIGTERM on (serve_grpc's drain)
        self.draining = False
        #: the tasks of the open streams (``Process``)
        self.streams: set[asyncio.Task[object]] = set()

    async def start(self) -> None:
        """Start following the engines' caches and loads (cache-aware only)."""
        if self.tracker is not None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._tracking = asyncio.create_task(self.tracker.run(self.session, self._stop))

    async def close(self) -> None:
        if self._tracking is not None:
            self._stop.set()
            await asyncio.gather(self._tracking, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        busy: Pair | None = None
        held: ep.ProcessingRequest | None = None   # request headers waiting for the body
        body = bytearray()
        m.PICKER_STREAMS.inc()
        task = asyncio.current_task()
        if task is not None:
            self.streams.add(task)
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    if self.tracker is not None and not request.request_headers.end_of_stream:
                        held = request
                        continue
                    response, busy = self._on_headers(request, None)
                    yield response
                    if busy is None:
                        return
                elif kind == "request_body" and held is not None:
                    body += request.request_body.body
                    end = request.request_body.end_of_stream
                    if not end and len(body) <= MAX_HELD_BODY:
                        continue
                    replies, busy = await self._release_held(held, body, end, end)
                    held = None
                    for reply in replies:
                        yield reply
                    if busy is None:
                        return
                    body.clear()
                elif kind == "request_body":
                    yield ep.ProcessingResponse(request_body=_echo(request.request_body))
                elif kind == "response_headers":
                    pair = ([(PAIR_HEADER, busy.label), (REVISION_HEADER, busy.revision)]
                            if busy is not None else [])  # fmt: skip
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse(
                        response=ep.CommonResponse(header_mutation=_set_headers(pair))))
                elif kind == "response_body":
                    yield ep.ProcessingResponse(response_body=_echo(request.response_body))
                    if request.response_body.end_of_stream and busy is not None:
                        self._release(busy)
                        busy = None
                elif kind == "request_trailers":
                    if held is not None:   # the body ended with trailers, not a flag
                        replies, busy = await self._release_held(held, body, True, False)
                        held = None
                        for reply in replies:
                            yield reply
                        if busy is None:
                            return
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            m.PICKER_STREAMS.dec()
            if task is not None:
                self.streams.discard(task)
            if busy is not None:
                self._release(busy)

    async def _release_held(self, held: ep.ProcessingRequest, body: bytearray, complete: bool,
                            end_of_stream: bool
                            ) -> tuple[list[ep.ProcessingResponse], Pair | None]:  # fmt: skip
        """The pick for held request headers, made on the body read so far (its prompt when
        ``complete``), and the replies: the headers' answer, then the body unless refused."""
        response, busy = self._on_headers(held, await self._prompt(body, complete))
        if busy is None:
            return [response], None
        return [response, *_held_body(bytes(body), end_of_stream)], busy

    async def _prompt(self, body: bytes | bytearray, complete: bool) -> Prompt | None:
        """The held body's prompt; None when it is incomplete (too large) or not JSON."""
        if not complete or self.tracker is None or self.session is None:
            return None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return await self.tracker.prompt(self.session, parsed, self.table())

    def _on_headers(self, request: ep.ProcessingRequest, prompt: Prompt | None
                    ) -> tuple[ep.ProcessingResponse, Pair | None]:  # fmt: skip
        began = time.perf_counter()
        decision = pick(self.table(), self.balancer, self.settings, subset_hint(request),
                        prompt)  # fmt: skip
        m.PICK_SECONDS.observe(time.perf_counter() - began)
        if isinstance(decision, NoPick):
            m.PICKS.labels("no_pair", *m.pair_labels(None)).inc()
            if decision.message != self._last_refusal:   # once per reason, not per request
                log.warning("answering 503: %s", decision.message)
                self._last_refusal = decision.message
            return _unavailable(decision.status, decision.message), None
        pair = decision.pair
        if self.tracker is not None:
            self.tracker.chosen(decision.decision, prompt)
        self._last_refusal = ""
        self.balancer.start(pair.decode)
        self.balancer.start(pair.prefill, pair.prefill_blocks)
        m.PICKS.labels("picked", *m.pair_labels(pair)).inc()
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {"x-gateway-destination-endpoint": decision.destination}})
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(
                header_mutation=_set_headers(decision.headers), clear_route_cache=True)),
            dynamic_metadata=metadata), pair

    def _release(self, pair: Pair) -> None:
        self.balancer.done(pair.decode)
        self.balancer.done(pair.prefill, pair.prefill_blocks)


async def serve_grpc(picker: EndpointPicker, address: str, synced: Callable[[], bool],
                     stop: asyncio.Event, drain: DrainSettings | None = None,
                     hurry: asyncio.Event | None = None) -> None:  # fmt: skip
    """Serve ext_proc and gRPC health on ``address`` until ``stop`` is set, then drain (module
    docstring; without ``drain``, open streams get 5 s); ``hurry`` ends the drain at once."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(address)
    await server.start()
    await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    ready: bool | None = None
    try:
        while not stop.is_set():
            now = synced()
            if now != ready:
                status = (health_pb2.HealthCheckResponse.SERVING if now
                          else health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
                for service in ("readiness", EXT_PROC_SERVICE, ""):
                    await checks.set(service, status)
                ready = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
        if drain is not None:
            await _drain(server, checks, picker, drain, hurry)
    finally:
        await server.stop(grace=5)


async def _drain(server: grpc.aio.Server, checks: health.aio.HealthServicer,
                 picker: EndpointPicker, drain: DrainSettings, hurry: asyncio.Event | None
                 ) -> None:  # fmt: skip
    picker.draining = True
    m.PICKER_DRAINING.set(1)
    for service in ("readiness", EXT_PROC_SERVICE, ""):
        await checks.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: gRPC readiness NOT_SERVING; taking streams for %g s more, then %d "
             "open get %g s to finish", drain.delay_s, len(picker.streams), drain.grace_s)
    await pause(drain.delay_s, hurry)
    # No new streams from here on. The server's own grace outlasts ours, which cuts first:
    # a second stop without a grace cancels the streams still open.
    stopping = asyncio.create_task(server.stop(grace=drain.grace_s + CUT_WAIT_S))
    cut = await settle(lambda: picker.streams, drain.grace_s, hurry)
    if cut:
        log.warning("drain grace (%g s) over: cancelling %d open stream(s)", drain.grace_s,
                    len(cut))
        m.PICKER_DRAIN_CUTS.inc(len(cut))
        await server.stop(grace=None)
    await stopping
    log.info("drained: %d stream(s) cut", len(cut))

