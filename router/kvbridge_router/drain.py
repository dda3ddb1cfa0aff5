"""Leaving on SIGTERM without failing a request: the router's (and the sidecar's) drain, and
the waits the endpoint picker's drain shares (extproc.py).

Kubernetes sends SIGTERM when it deletes a pod and, at the same time, not before, starts
taking the pod out of its Service's endpoints; kube-proxy, an ingress or a gateway's Envoy
learn it a moment later and send new connections to the pod until then. A listener that closed
at once would refuse those: the connection errors a deleted router pod used to cause. So on
SIGTERM:

1. readiness (``/ready``) answers 503 at once, while liveness (``/health``, the TCP probe)
   stays as it was: the pod leaves the endpoints, and is not restarted for it;
2. for the drain delay (``delay_s``) the listener still accepts and every request is served
   as before, its answer sent with ``Connection: close`` so that no keep-alive connection
   carries a later request to a pod that is leaving;
3. then the listener closes, idle keep-alive connections close, and the requests in flight,
   streams included, get the drain grace (``grace_s``) to finish;
4. a request still in flight when the grace ends is cut with an error, never with a short
   answer that looks complete: a 503 with vLLM's error body when its answer had not started;
   in a stream, an error event (``data: {"error": ...}``) and no ``data: [DONE]``. Cutting
   closes its engine connections, so vLLM aborts the request. Counted in
   ``kvbridge_router_drain_cut_requests_total{stage}`` and as outcome ``shutdown``.

A second SIGTERM or SIGINT ends the delay and the grace at once (``hurry``). The pod's
``terminationGracePeriodSeconds`` must exceed the delay plus the grace (the chart adds 10 s),
or the kubelet's SIGKILL cuts requests without an error event.

Threads: the loop's only; the handlers in flight are the aiohttp tasks this middleware saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import metrics as m
from . import sse, tally
from .client_errors import error_body
from .flow import CHAT, COMPLETIONS
from .upstream import SSE, error_response

__all__ = ["CUT_WAIT_S", "SHUTDOWN", "Drain", "DrainSettings", "pause", "settle"]

log = logging.getLogger("kvbridge.router")

#: the outcome (kvbridge_router_requests_total) of a request cut when the grace ended
SHUTDOWN = "shutdown"
#: how long cut handlers get to write their error and end, after the grace
CUT_WAIT_S = 2.0
#: a request's response, once its headers went out
_PREPARED = web.RequestKey("kvbridge_drain_prepared", web.StreamResponse)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class DrainSettings:
    #: from SIGTERM, how long the listener still accepts while readiness answers 503
    delay_s: float = 5.0
    #: then, how long requests in flight get to finish before they are cut
    grace_s: float = 25.0

    def __post_init__(self) -> None:
        for name in ("delay_s", "grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"drain_{name[:-2]}_seconds: expected >= 0, got "
                                 f"{getattr(self, name)}")


async def pause(seconds: float, hurry: asyncio.Event | None) -> None:
    """``seconds``, or less once ``hurry`` is set."""
    if hurry is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(hurry.wait(), timeout=seconds)


async def settle(in_flight: Callable[[], Collection[asyncio.Task[Any]]], seconds: float,
                 hurry: asyncio.Event | None) -> list[asyncio.Task[Any]]:  # fmt: skip
    """Wait until ``in_flight()`` is empty, for ``seconds`` at most (less once ``hurry`` is
    set); the tasks still in flight then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    hurried = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
    try:
        while in_flight() and (left := deadline - loop.time()) > 0:
            waits: set[asyncio.Future[Any]] = set(in_flight())
            if hurried is not None:
                if hurried.done():
                    break
                waits.add(hurried)
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if hurried is not None:
            hurried.cancel()
    return [t for t in in_flight() if not t.done()]


class Drain:
    """One HTTP front's drain: ``install`` on its app, ``shut_down`` after SIGTERM."""

    def __init__(self, settings: DrainSettings) -> None:
        self.settings = settings
        self.draining = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()

    def install(self, app: web.Application, ready: Handler) -> web.Application:
        """``app`` with ``/ready`` (503 while draining, else ``ready``'s answer), its
        requests followed, and ``Connection: close`` on every answer while draining."""
        async def readiness(request: web.Request) -> web.StreamResponse:
            if self.draining:
                return web.json_response({"status": "draining"}, status=503)
            return await ready(request)

        @web.middleware
        async def follow(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self._follow(request, handler)

        app.router.add_get("/ready", readiness)
        app.middlewares.append(follow)
        app.on_response_prepare.append(self._prepared)
        return app

    async def shut_down(self, runner: web.AppRunner, hurry: asyncio.Event | None = None
                        ) -> int:  # fmt: skip
        """The drain (module docstring), then the runner's cleanup; the requests cut."""
        self.draining = True
        m.DRAINING.set(1)
        delay, grace = self.settings.delay_s, self.settings.grace_s
        log.info("draining: /ready answers 503; taking requests for %g s more, then %d in "
                 "flight get %g s to finish", delay, len(self._tasks), grace)
        await pause(delay, hurry)
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            runner.server.pre_shutdown()    # idle keep-alive connections close now
        await asyncio.sleep(0)
        cut = await settle(lambda: self._tasks, grace, hurry)
        if cut:
            log.warning("drain grace (%g s) over: cutting %d request(s) still in flight",
                        grace, len(cut))
            for task in cut:
                self._cut.add(task)
                task.cancel()
            await asyncio.wait(cut, timeout=CUT_WAIT_S)
        await runner.cleanup()
        log.info("drained: %d request(s) cut", len(cut))
        return len(cut)

    async def _prepared(self, request: web.Request, response: web.StreamResponse) -> None:
        request[_PREPARED] = response
        if self.draining:   # aiohttp has set its Connection header by now, not yet sent it
            response.force_close()
            response.headers["Connection"] = "close"

    async def _follow(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A completion is counted here, not in its handler, so that a cut one counts as cut.
        counted = request.method == "POST" and request.path in (COMPLETIONS, CHAT)
        with tally.opened() if counted else contextlib.nullcontext() as count:
            try:
                return await handler(request)
            except asyncio.CancelledError:
                if task not in self._cut:
                    raise       # the client went away
                task.uncancel()
                return await self._cut_short(request, count)

    async def _cut_short(self, request: web.Request, count: tally.Tally | None
                         ) -> web.StreamResponse:  # fmt: skip
        """The end of a request cut when the grace ended: an error, never a short success."""
        message = (f"the router stopped before this request finished (its drain grace of "
                   f"{self.settings.grace_s:g} s ended); send it again")
        response: web.StreamResponse | None = request.get(_PREPARED)
        if response is None:
            m.DRAIN_CUTS.labels("waiting").inc()
            if count is not None:
                count.settle(SHUTDOWN)
            return error_response(503, message, "service_unavailable")  # closes (_prepared)
        if count is not None and count.outcome == "answered":
            return response     # the stream's [DONE] went out: complete
        m.DRAIN_CUTS.labels("streaming").inc()
        if count is not None:
            count.settle(SHUTDOWN)
        if response.content_type != SSE:    # no way to say it in the body: no clean end
            if request.transport is not None:
                request.transport.abort()
            return response
        # A blank line first ends an event the stream may have been cut in the middle of.
        error = sse.event(json.dumps(error_body(message, "service_unavailable", 503)).encode())
        with contextlib.suppress(ConnectionError):
            await response.write(b"\n\n" + error)
            await response.write_eof()
        return response
