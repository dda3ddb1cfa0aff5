"""The P/D sidecar of a decode pod: the router's flow (proxy.py) for requests an inference
gateway sends to this decode, with the prefill named by the gateway's endpoint picker.

The picker (picker.py) names a verified prefill of this decode in a request header
(``x-prefiller-host-port``, llm-d's name, or the proposed ``x-prefill-host-port``). The
sidecar calls that prefill, then its own vLLM on localhost, with the router's lease guard,
abort path and retry. A header is honoured only when it names one of this decode's verified
prefills in the routing table (the KVTransfer watch): a client that sets it itself can never
make the sidecar call an arbitrary address. A named prefill that fails is retried once on
another verified prefill of this decode.

Without the header (a request that did not come through the picker) the sidecar refuses
(``refuse``, the default: nothing silently loses disaggregation) or serves the request from
its own engine alone (``local``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from aiohttp import web

from . import metrics as m
from .balance import Pair, Prompt
from .errors import Refusal, UpstreamError
from .proxy import Router
from .settings import RouterSettings
from .table import Engine, RoutingTable
from .upstream import error_response

#: llm-d's routing sidecar reads the first; the second is the name proposed for the
#: inference extension's P/D standard.
PREFILL_HEADERS = ("x-prefiller-host-port", "x-prefill-host-port")
WITHOUT_HEADER = ("refuse", "local")


@dataclass(frozen=True)
class SidecarSettings:
    #: this decode's pod (``$POD_NAME``): its engine is the one whose KVEndpoints name it
    pod_name: str
    #: this decode's vLLM, reached on the pod's loopback
    decode_url: str = "http://127.0.0.1:8200"
    prefill_headers: Sequence[str] = PREFILL_HEADERS
    without_header: str = "refuse"


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as headers name an endpoint (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_port(engine: Engine, default_port: int) -> str:
    """``host:port`` of an engine's OpenAI server."""
    return join_host_port(engine.host, engine.port or default_port)


def own_decode(table: RoutingTable, pod_name: str) -> Engine | None:
    """The decode engine this pod serves (any of its ranks' pods), if the table has it."""
    for engine in table.engines.values():
        if engine.role == "decode" and pod_name in engine.pods:
            return engine
    return None


def named_prefill(table: RoutingTable, decode: Engine, named: str, engine_port: int
                  ) -> Engine:  # fmt: skip
    """The verified prefill of ``decode`` that ``named`` (host:port) designates; a
    :class:`Refusal` when it designates none: 403 for an address that is no prefill of this
    KVTransfer, 503 for a prefill that is not (or no longer) verified with this decode."""
    named = named.strip()
    for prefill in table.prefills_of(decode.engine_id):
        if host_port(prefill, engine_port) == named:
            return prefill
    known = {host_port(e, engine_port): e for e in table.engines.values() if e.role == "prefill"}
    if named in known:
        raise Refusal(503, f"prefill {known[named].engine_id} ({named}) is not a verified peer "
                      f"of decode {decode.engine_id} now", "no_verified_pair")
    raise Refusal(403, f"{named!r} is no prefill of this decode's KVTransfer: the sidecar "
                  "calls only verified prefills of its own decode", "permission_error")


class Sidecar(Router):
    """The router's request handling with the pair fixed by the request: this pod's decode
    and the prefill the picker named."""

    def __init__(self, table: Router.TableSource, settings: RouterSettings,
                 sidecar: SidecarSettings) -> None:  # fmt: skip
        super().__init__(table, settings)
        if sidecar.without_header not in WITHOUT_HEADER:
            raise ValueError(f"without_header: expected one of {', '.join(WITHOUT_HEADER)}, "
                             f"got {sidecar.without_header!r}")
        self.sidecar = sidecar

    def _decode_of(self, table: RoutingTable) -> Engine:
        decode = own_decode(table, self.sidecar.pod_name)
        if decode is None:
            raise Refusal(503, f"pod {self.sidecar.pod_name} has no decode KVEndpoint in the "
                          f"routing table: {table.reason or 'not published yet'}",
                          "no_verified_pair")
        return decode

    async def health(self, _request: web.Request) -> web.Response:
        """Ready to serve P/D: this pod's decode has at least one verified prefill."""
        table = self.table()
        decode = own_decode(table, self.sidecar.pod_name)
        prefills = table.prefills_of(decode.engine_id) if decode is not None else []
        if prefills:
            return web.json_response({"status": "ok", "decode": decode.engine_id,
                                      "verifiedPrefills": len(prefills)})  # fmt: skip
        why = (f"decode {decode.engine_id} has no verified prefill" if decode is not None
               else f"pod {self.sidecar.pod_name} has no decode KVEndpoint")
        return web.json_response({"status": "unavailable", "reason": f"{why}: "
                                  f"{table.reason or 'not verified yet'}"}, status=503)

    def _named(self, request: web.Request) -> str | None:
        for name in self.sidecar.prefill_headers:
            value = request.headers.get(name)
            if value:
                return value.split(",")[0]
        return None

    def choose(self, request: web.Request, table: RoutingTable,
               avoid: Collection[tuple[str, str]], prompt: Prompt | None = None
               ) -> Pair | None:  # fmt: skip
        decode = self._decode_of(table)
        named = self._named(request)
        if named is None:
            raise Refusal(400, f"{self.sidecar.prefill_headers[0]}: expected the prefill's "
                          "host:port, as the endpoint picker sets it (this sidecar serves P/D "
                          "requests only)", "invalid_request_error")
        if not avoid:
            return Pair(decode, named_prefill(table, decode, named, self.settings.engine_port))
        # The named prefill failed: another verified prefill of this decode, if any.
        return self.balancer.pick(table, avoid, decodes=(decode.engine_id,))

    def _url(self, engine: Engine, path: str) -> str:
        if engine.role == "decode":
            return f"{self.sidecar.decode_url}{path}"
        return super()._url(engine, path)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.sidecar.without_header == "local" and self._named(request) is None:
            return await self._local(request)
        return await super().generate(request)

    async def _local(self, request: web.Request) -> web.StreamResponse:
        """The request as the client sent it, to this pod's own engine alone."""
        started = time.monotonic()
        body = await self._read_body(request)
        if isinstance(body, web.StreamResponse):
            return body
        try:
            decode = self._decode_of(self.table())
        except Refusal as exc:
            return self._refuse(exc)
        # Counted with the decode as its own prefill: no KV crosses engines.
        pair = Pair(decode, decode)
        self._start(decode)
        try:
            return await self._decode(request, body, pair, started)
        except UpstreamError as exc:
            return self._count(error_response(502, str(exc), "upstream_error"), "failed", pair)
        finally:
            self._done(decode)
            m.TOTAL_SECONDS.observe(time.monotonic() - started)
