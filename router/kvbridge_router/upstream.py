"""What a P/D request ends in: an :class:`Upstream` (a decode's answer, its first bytes
received, still to relay) or an :class:`Answer` (the client's answer when none is left to
relay), and the error answers and events a client sees."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from . import metrics as m
from . import sse
from .balance import REVISION_HEADER, Pair
from .client_errors import error_body

__all__ = [
    "JSON_CONTENT_TYPE",
    "JSON_HEADERS",
    "SSE",
    "Answer",
    "Upstream",
    "close_all",
    "decode_json",
    "encode",
    "error_response",
    "stamp",
    "stream_error",
]

SSE = "text/event-stream"
JSON_CONTENT_TYPE = "application/json"
JSON_HEADERS = {"Content-Type": JSON_CONTENT_TYPE}
encode = msgspec.json.Encoder().encode
decode_json = msgspec.json.Decoder().decode


def error_response(status: int, message: str, kind: str, param: str | None = None
                   ) -> web.Response:  # fmt: skip
    return web.json_response(error_body(message, kind, status, param), status=status)


@dataclass(frozen=True)
class Answer:
    """How a P/D request ended when no decode answer is left to relay: the client's answer
    and its outcome."""

    status: int
    body: bytes
    outcome: str
    pair: Pair | None = None
    content_type: str = JSON_CONTENT_TYPE

    @classmethod
    def error(cls, status: int, message: str, kind: str, outcome: str,
              pair: Pair | None = None) -> Answer:  # fmt: skip
        return cls(status, encode(error_body(message, kind, status)), outcome, pair)

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body,
                            headers={"Content-Type": self.content_type})  # fmt: skip


class Upstream:
    """A decode's answer once its status and first bytes arrived (all of it unless it
    streams). ``close`` ends it: the connection closes if it was not read to the end, which
    makes vLLM abort the request."""

    def __init__(self, resp: aiohttp.ClientResponse, first: bytes, pair: Pair, began: float,
                 streaming: bool) -> None:  # fmt: skip
        self.resp, self.first, self.pair, self.streaming = resp, first, pair, streaming
        self._began = began
        self._on_close: list[Callable[[], None]] = []
        self._closed = False

    @property
    def status(self) -> int:
        return self.resp.status

    @property
    def content_type(self) -> str:
        return self.resp.headers.get("Content-Type", "")

    async def rest(self) -> AsyncIterator[bytes]:
        """The bytes after ``first``, as they arrive."""
        async for chunk in self.resp.content.iter_any():
            yield chunk

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.resp.release()
        m.DECODE_SECONDS.observe(time.monotonic() - self._began)
        for callback in self._on_close:
            callback()

    def rejection(self) -> Answer | None:
        """The decode's 4xx as the client's answer (closed), or None."""
        if self.status < 400:
            return None
        self.close()
        return Answer(self.status, self.first, "rejected", self.pair,
                      self.content_type or JSON_CONTENT_TYPE)  # fmt: skip


def stamp(response: web.StreamResponse, pair: Pair | None) -> web.StreamResponse:
    """``response`` with the revision of the pair that served (before it is sent; an answer
    no pair served carries none)."""
    if pair is not None and not response.prepared:
        response.headers[REVISION_HEADER] = pair.revision
    return response


def stream_error(pair: Pair, exc: BaseException) -> bytes:
    """The error event that ends a stream whose decode failed after the first byte."""
    return sse.event(json.dumps(error_body(
        f"decode {pair.decode.engine_id} failed after the first byte: "
        f"{type(exc).__name__}: {exc}", "upstream_error", 502)).encode())


def close_all(results: Collection[Any]) -> None:
    for result in results:
        if isinstance(result, Upstream):
            result.close()
