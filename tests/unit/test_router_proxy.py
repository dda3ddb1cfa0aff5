"""The router's failure handling, against engines that fail on purpose (aiohttp servers
playing vLLM's P/D endpoints; the real engines are in tests/node/test_serving_vllm.py): a
failed prefill or a decode that fails before its first byte is retried once on another pair,
a decode that fails mid-stream ends the stream with an error event, no verified pair is a 503
with the reason, and a bad request is a 400 naming the field. And the front door: every
request counted once (a client closing right after ``[DONE]`` included), bodies bounded in
size, time, media type and nesting, slow headers cut off, malformed requests logged briefly.
The router runs with the production server options (``__main__._serve_http``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine

from kvbridge_router import metrics as m
from kvbridge_router import tally
from kvbridge_router.__main__ import _serve_http
from kvbridge_router.balance import REVISION_HEADER
from kvbridge_router.limits import MEDIA_TYPE_MESSAGE, PARSE_MESSAGE
from kvbridge_router.logfilter import MalformedRequests
from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.table import Engine, RoutingTable
from kvbridge_testkit.prometheus import counts_by_label
from local_http import serve_locally

#: the model revision every fake engine publishes
REVISION = "rev-7"


class FakeEngine:
    """One engine on 127.0.0.1; ``mode`` decides how it answers: ok, error (HTTP 500),
    drop (closes the connection before answering), midstream (streams a chunk, then drops),
    partial (a non-streaming answer: its headers and part of its body, then drops), linger
    (a stream whose response stays open after ``[DONE]`` until the router closes it) or hang
    (a stream that stays open after its first chunk until the router closes it)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode, self.calls = name, mode, 0
        self.runner: web.AppRunner | None = None
        self.port = 0
        #: set when a lingering stream's connection was closed by the router
        self.disconnected = asyncio.Event()

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner, self.port = await serve_locally(app)
        return self

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        params = body["kv_transfer_params"]
        if self.mode == "error":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.1)
            return web.Response()
        if params.get("do_remote_decode"):       # the prefill step
            assert body["max_tokens"] == 1 and body["stream"] is False
            return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": self.name}})
        text = f"{params['remote_engine_id']}->{self.name}"
        if self.mode == "partial" and not body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "application/json",
                                              "Content-Length": "1000"})
            await out.prepare(request)
            await out.write(b'{"choices": [{"text": "')
            assert request.transport is not None
            request.transport.close()
            return out
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": text}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
        if self.mode == "midstream":
            assert request.transport is not None
            request.transport.close()
            return out
        if self.mode != "hang":
            await out.write(b"data: [DONE]\n\n")
        if self.mode in ("linger", "hang"):
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)
            self.disconnected.set()
        return out

    def engine(self, role: str) -> Engine:
        return Engine(self.name, role, "127.0.0.1", (self.name,), port=self.port,
                      model_revision=REVISION)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def run(scenario: Callable[..., Any], settings: RouterSettings | None = None, **modes: str
        ) -> Any:  # fmt: skip
    """Start fake engines named by ``modes`` (p*: prefills, d*: decodes, every decode paired
    with every prefill), a router in front of them, and run ``scenario(url, engines)``."""
    async def main() -> Any:
        engines = {n: await FakeEngine(n, mode).start() for n, mode in modes.items()}
        ports = {e.port for e in engines.values()}
        assert len(ports) == len(engines)
        table = RoutingTable(
            {d: tuple(p for p in engines if p.startswith("p")) for d in engines
             if d.startswith("d")},
            {n: e.engine("prefill" if n.startswith("p") else "decode") for n, e in engines.items()},
            reason="" if engines else "nothing")  # fmt: skip
        router = Router(lambda: table, settings or RouterSettings())
        runner = await _serve_http(router.app(), "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            return await scenario(f"http://127.0.0.1:{port}", engines)
        finally:
            await runner.cleanup()
            for e in engines.values():
                await e.stop()
    return asyncio.run(main())


async def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.text()


PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 4}


def test_every_answer_a_pair_served_names_its_revision() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        async with aiohttp.ClientSession() as s:
            for body in (PROMPT, {**PROMPT, "stream": True}, {**PROMPT, "prompt": ["a", "b"]},
                         {**PROMPT, "prompt": ["a", "b"], "stream": True}):
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200 and r.headers[REVISION_HEADER] == REVISION, body
            async with s.post(f"{url}/v1/completions",
                              json={**PROMPT, "kv_transfer_params": {}}) as r:
                assert r.status == 400 and REVISION_HEADER not in r.headers  # no pair served
    run(scenario, p0="ok", d0="ok")


def test_answers_over_the_pair_and_retries_a_failed_prefill_elsewhere() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(4):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p1->d0"
        assert engines["p0"].calls >= 1 and engines["p1"].calls == 4
    run(scenario, p0="error", p1="ok", d0="ok")


def test_decode_failure_before_the_first_byte_is_retried_on_another_pair() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(3):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p0->d1"
        assert engines["d0"].calls >= 1
    run(scenario, p0="ok", d0="drop", d1="ok")


def test_a_whole_answer_cut_short_is_retried_on_another_pair() -> None:
    """A non-streaming answer goes to the client in one piece, so a decode that fails in
    the middle of it has sent the client nothing yet: the request is retried, not broken."""
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        for _ in range(3):
            status, text = await post(url, PROMPT)
            assert status == 200 and json.loads(text)["choices"][0]["text"] == "p0->d1"
        assert engines["d0"].calls >= 1
    run(scenario, p0="ok", d0="partial", d1="ok")


def test_every_pair_failing_is_a_502_naming_the_attempts() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, PROMPT)
        assert status == 502
        message = json.loads(text)["error"]["message"]
        assert "p0->d0" in message and "p0->d1" in message
        assert engines["d0"].calls + engines["d1"].calls == 2    # one try and one retry
    run(scenario, p0="ok", d0="error", d1="error")


def test_mid_stream_failure_ends_the_stream_with_an_error_event() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, {**PROMPT, "stream": True})
        assert status == 200
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert events[0]["choices"][0]["text"] == "p0->d0"
        assert events[-1]["error"]["type"] == "upstream_error"
        assert "[DONE]" not in text        # a cut answer never looks complete
    run(scenario, p0="ok", d0="midstream")


def test_a_fanned_out_stream_failing_mid_answer_ends_with_one_error_event() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        status, text = await post(url, {**PROMPT, "prompt": ["a", "b"], "stream": True})
        assert status == 200
        data = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert data.count("[DONE]") == 0 and data[-1].startswith('{"error"')
        errors = [json.loads(d) for d in data if d.startswith('{"error"')]
        assert len(errors) == 1 and errors[0]["error"]["type"] == "upstream_error"
        assert outcomes() - before == Counter(stream_error=1)
    run(scenario, p0="ok", d0="midstream")


def test_no_verified_pair_and_bad_requests() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        status, text = await post(url, PROMPT)
        assert status == 503 and "no verified prefill/decode pair: nothing" in text
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            assert r.status == 503 and (await r.json())["reason"] == "nothing"
        # Batched prompts are served now (test_router_openai.py): no pair, not refused.
        status, text = await post(url, {**PROMPT, "prompt": ["a", "b"]})
        assert status == 503 and "no verified prefill/decode pair" in text
        status, text = await post(url, {**PROMPT, "kv_transfer_params": {}})
        assert status == 400 and "kv_transfer_params" in text
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    run(scenario)


# -- counting ------------------------------------------------------------------------------
def outcomes() -> Counter[str]:
    """kvbridge_router_requests_total by outcome, all pairs together."""
    return counts_by_label(m.REQUESTS, "kvbridge_router_requests_total", "outcome")


def test_a_tally_counts_its_request_once_however_the_handler_ends() -> None:
    before = outcomes()
    with tally.opened() as outer:
        outer.settle("rejected")
        with tally.opened() as inner:       # the one already open
            assert inner is outer
    assert outcomes() - before == Counter(rejected=1)
    with contextlib.suppress(asyncio.CancelledError), tally.opened():
        raise asyncio.CancelledError
    with contextlib.suppress(RuntimeError), tally.opened():
        raise RuntimeError("a bug of the router's")
    with contextlib.suppress(KeyError), tally.opened(drop_on=KeyError):
        raise KeyError("counted by the caller")
    assert outcomes() - before == Counter(rejected=1, cancelled=1, failed=1)


def test_a_stream_closed_right_after_done_is_counted_once_as_answered() -> None:
    """The openai client closes the connection as soon as it read ``data: [DONE]``; here
    the decode keeps its response open after it, so the router's handler is still relaying
    when the client leaves and is cancelled there."""
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        async with aiohttp.ClientSession() as s, s.post(
                f"{url}/v1/completions", json={**PROMPT, "stream": True}) as r:
            seen = b""
            async for chunk in r.content.iter_any():
                seen += chunk
                if b"data: [DONE]" in seen:
                    break
        # Leaving the block closed the connection mid-response: the handler was cancelled,
        # and so the decode's connection was closed.
        await engines["d0"].disconnected.wait()
        assert outcomes() - before == Counter(answered=1)
        status, _ = await post(url, PROMPT)
        assert status == 200 and outcomes() - before == Counter(answered=2)
    run(scenario, p0="ok", d0="linger")


def test_a_client_that_leaves_mid_stream_is_counted_once_as_cancelled() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        async with aiohttp.ClientSession() as s, s.post(
                f"{url}/v1/completions", json={**PROMPT, "stream": True}) as r:
            assert (await r.content.readany()).startswith(b"data: {")
        await engines["d0"].disconnected.wait()
        assert outcomes() - before == Counter(cancelled=1)
    run(scenario, p0="ok", d0="hang")


def test_counters_rise_by_exactly_the_requests_sent() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        sent = [await post(url, PROMPT), await post(url, {**PROMPT, "stream": True}),
                await post(url, {**PROMPT, "prompt": ["a", "b", "c"]}),
                await post(url, {**PROMPT, "prompt": ["a", "b"], "stream": True}),
                await post(url, {**PROMPT, "kv_transfer_params": {}})]
        async with aiohttp.ClientSession() as s, s.post(
                f"{url}/v1/completions", data=b"{not json",
                headers={"Content-Type": "application/json"}) as r:
            sent.append((r.status, await r.text()))
        assert [status for status, _ in sent] == [200, 200, 200, 200, 400, 400]
        assert outcomes() - before == Counter(answered=4, rejected=2)
    run(scenario, p0="ok", d0="ok")


# -- the front door ------------------------------------------------------------------------
async def raw_exchange(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` and ``body`` on a connection of its own; the answer's status line."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        return await reader.readline()
    finally:
        writer.close()


def test_bodies_the_engine_would_refuse_are_400s_in_its_words() -> None:
    """The answers vLLM 0.30.0 gave to the same bodies (its FastAPI server's words)."""
    def validation(error: str, param: str) -> dict[str, Any]:
        return {"error": {"message": f"1 validation error:\n  {error}", "type": "Bad Request",
                          "param": param, "code": 400}}

    nested = b'{"model": "m", "prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    as_text = json.dumps(PROMPT).encode()
    media = {"error": {"message": MEDIA_TYPE_MESSAGE, "type": "Bad Request", "param": None,
                       "code": 400}}  # fmt: skip
    cases = [
        (nested, "application/json", {"detail": PARSE_MESSAGE}),
        (as_text, "text/plain", media), (as_text, None, media),
        (b"{not json", "application/json", validation(
            "{'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': "
            "'<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double "
            "quotes'}}", "body.1")),
        (b'{"model":"tiny-llama","prompt":"a","max_tokens":2', "application/json", validation(
            "{'type': 'json_invalid', 'loc': 'body.49', 'msg': 'JSON decode error', 'input': "
            "'<dict of 0 items>', 'ctx': {'error': \"Expecting ',' delimiter\"}}", "body.49")),
        (b"", "application/json", validation(
            "{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}",
            "body")),
        (b"[1,2]", "application/json", validation(
            "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid "
            "dictionary or object to extract fields from', 'input': '<list of 2 items>'}",
            "body")),
        (b'"x"', "application/json", validation(
            "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid "
            "dictionary or object to extract fields from', 'input': 'x'}", "body")),
    ]  # fmt: skip

    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        async with aiohttp.ClientSession() as s:
            for data, content_type, answer in cases:
                headers = {"Content-Type": content_type} if content_type else {}
                async with s.post(f"{url}/v1/completions", data=data, headers=headers,
                                  skip_auto_headers={"Content-Type"}) as r:
                    assert (r.status, await r.json(content_type=None)) == (400, answer), data
            # The connection stays usable after a refused media type.
            async with s.post(f"{url}/v1/completions", json=PROMPT) as r:
                assert r.status == 200
        assert engines["p0"].calls == 1
        assert outcomes() - before == Counter(rejected=len(cases), answered=1)
    run(scenario, p0="ok", d0="ok")


def test_a_declared_body_over_the_limit_is_refused_before_it_arrives() -> None:
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        before = outcomes()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
        # 1 MiB of the declared 1 GiB, then nothing more: the answer comes all the same.
        status = await raw_exchange(url, head, b" " * 2**20)
        assert status.startswith(b"HTTP/1.1 413")
        assert outcomes() - before == Counter(rejected=1)
    run(scenario, p0="ok", d0="ok")


def test_a_stalled_body_is_a_408() -> None:
    async def scenario(url: str, engines: dict[str, FakeEngine]) -> None:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        status = await raw_exchange(url, head, b'{"model": ')
        assert status.startswith(b"HTTP/1.1 408")
        assert engines["p0"].calls == 0
    run(scenario, RouterSettings(body_timeout_s=0.2), p0="ok", d0="ok")


def test_connections_sending_their_headers_byte_by_byte_are_closed() -> None:
    """Slowloris: 200 connections that never finish their headers. Each is closed by the
    router; the router still answers a request afterwards."""
    async def slow_client(host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                # One header that never ends, well within aiohttp's line and field limits.
                for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.05)
        sender = asyncio.create_task(trickle())
        try:
            with contextlib.suppress(ConnectionError):
                assert await reader.read() == b""     # closed by the router, nothing answered
        finally:
            sender.cancel()
            writer.close()

    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        host, port = url.removeprefix("http://").split(":")
        await asyncio.gather(*(slow_client(host, int(port)) for _ in range(200)))
        assert (await post(url, PROMPT))[0] == 200
    run(scenario, RouterSettings(header_timeout_s=0.5), p0="ok", d0="ok")


def test_malformed_requests_are_logged_in_one_line_at_most_once_an_interval() -> None:
    now = [100.0]
    quiet = MalformedRequests(interval_s=10.0, clock=lambda: now[0])

    def record(exc: BaseException, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", level, __file__, 1,
                                 "Error handling request from %s", ("203.0.113.7",),
                                 (type(exc), exc, None))  # fmt: skip

    first = record(BadStatusLine("GET\x00 /\n  HTTP/1.1"))
    assert quiet.filter(first)
    assert first.levelno == logging.WARNING and first.exc_info is None
    line = first.getMessage()
    assert "\n" not in line and line.startswith("malformed request from 203.0.113.7: HTTP 400")
    assert not quiet.filter(record(BadStatusLine("again")))
    assert not quiet.filter(record(BadStatusLine("and again")))
    now[0] += 10.0
    third = record(BadStatusLine("later"))
    assert quiet.filter(third) and "(2 more since the last report)" in third.getMessage()
    # Other errors, and debug records, are left as they are.
    other = record(RuntimeError("a bug"))
    assert quiet.filter(other) and other.exc_info is not None
    debug = record(BadStatusLine("x"), logging.DEBUG)
    assert quiet.filter(debug) and debug.exc_info is not None


def test_a_real_routers_malformed_request_log_has_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    async def scenario(url: str, _engines: dict[str, FakeEngine]) -> None:
        status = await raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost x\r\n\r\n")
        assert status.split()[1] == b"400"
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        run(scenario, p0="ok", d0="ok")
    server = [r for r in caplog.records
              if r.name == "aiohttp.server" and r.levelno >= logging.WARNING]
    assert server and all(r.exc_info is None and r.levelno == logging.WARNING for r in server)
