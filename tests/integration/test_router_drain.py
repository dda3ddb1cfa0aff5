"""``kvbridge-router`` and ``kvbridge-router epp`` as processes sent a real SIGTERM, as the
kubelet sends it to a pod that is deleted or replaced by a rolling update (drain.py,
extproc.py): readiness fails at once while liveness stays, new requests (new ext_proc streams)
are still served for the drain delay, the listener then closes, requests in flight, streams
included, finish within the grace and the process exits; what outlasts the grace ends in an
error, never in a short answer that looks complete.

The engines are a slow aiohttp server playing vLLM's P/D endpoints (local_http.SlowEngine);
the router runs its own command line with a fixed routing table instead of the KVTransfer
watch (_static_router.py), so no API server is needed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge_router.picker import DESTINATION
from kvbridge_testkit.cluster import free_port, terminate
from local_http import SlowEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAUNCHER = Path(__file__).with_name("_static_router.py")
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip


def start(engine: SlowEngine, *argv: str) -> subprocess.Popen[str]:
    table = {"pairs": {"decode-0": ["prefill-0"]},
             "engines": {"decode-0": ["decode", "127.0.0.1", engine.port],
                         "prefill-0": ["prefill", "127.0.0.1", engine.port]}}  # fmt: skip
    return subprocess.Popen([sys.executable, str(LAUNCHER), json.dumps(table), *argv,
                             "--transfer", "t", "--namespace", "ns", "--host", "127.0.0.1"],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


async def until(predicate: Callable[[], Any], timeout: float = 20, step: float = 0.02) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError("condition never met")


async def status(url: str, expected: int | None = None) -> int | bool:
    """The status of GET ``url`` (0: no connection), or whether it is ``expected``."""
    code = await _status(url)
    return code if expected is None else code == expected


async def _status(url: str) -> int:
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return 0


async def complete(url: str, prompt: str, stream: bool = False, **extra: Any
                   ) -> tuple[int, str]:  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream, **extra}
    ) as r:  # fmt: skip
        return r.status, await r.text()


def events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def exited(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The return code and the log of a process that has exited."""
    assert proc.stderr is not None
    return proc.wait(timeout=5), proc.stderr.read()


def run(scenario: Callable[[SlowEngine], Any]) -> None:
    async def main() -> None:
        engine = await SlowEngine().start()
        try:
            await scenario(engine)
        finally:
            assert engine.runner is not None
            await engine.runner.cleanup()
    asyncio.run(main())


def test_a_router_drains_on_sigterm() -> None:
    async def scenario(engine: SlowEngine) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(engine, "--port", str(port), "--drain-delay-seconds", "3",
                     "--drain-grace-seconds", "30")  # fmt: skip
        try:
            await until(lambda: status(f"{url}/ready", 200), step=0.1)
            in_flight = [asyncio.create_task(complete(url, "12 0.3", stream=True)),
                         asyncio.create_task(complete(url, "8 0.4", stream=True, n=2)),
                         asyncio.create_task(complete(url, "12 0.3"))]
            await until(lambda: engine.decodes == 4)
            loop = asyncio.get_running_loop()
            signalled = loop.time()
            proc.send_signal(signal.SIGTERM)
            await until(lambda: status(f"{url}/ready", 503), timeout=2)   # at once
            assert await status(f"{url}/health") == 200
            # The delay: a new request is still served in full.
            code, text = await complete(url, "3 0.05", stream=True)
            assert code == 200 and events(text)[-1] == "[DONE]" and len(events(text)) == 4
            await until(lambda: loop.time() - signalled > 3.5)
            with pytest.raises(aiohttp.ClientConnectionError):     # the listener is closed
                await complete(url, "1 0")
            (c1, streamed), (c2, fanned), (c3, whole) = await asyncio.gather(*in_flight)
            assert (c1, c2, c3) == (200, 200, 200)
            assert events(streamed)[-1] == "[DONE]" and len(events(streamed)) == 13
            assert events(fanned)[-1] == "[DONE]" and len(events(fanned)) == 17
            assert "error" not in streamed + fanned
            assert json.loads(whole)["choices"][0]["text"].split() == [
                f"w{i}" for i in range(12)]
            await until(lambda: proc.poll() is not None, timeout=5)
            assert loop.time() - signalled < 15        # when they were done, not the grace
            code, log = exited(proc)
            assert code == 0 and "drained: 0 request(s) cut" in log, log
            assert engine.aborted == 0
        finally:
            terminate(proc, 5)
    run(scenario)


def test_what_outlasts_the_grace_ends_in_an_error() -> None:
    async def scenario(engine: SlowEngine) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(engine, "--port", str(port), "--drain-delay-seconds", "0.5",
                     "--drain-grace-seconds", "1")  # fmt: skip
        try:
            await until(lambda: status(f"{url}/ready", 200), step=0.1)
            in_flight = [asyncio.create_task(complete(url, "200 0.05", stream=True)),
                         asyncio.create_task(complete(url, "200 0.05"))]
            await until(lambda: engine.decodes == 2)
            proc.send_signal(signal.SIGTERM)
            (c1, streamed), (c2, whole) = await asyncio.gather(*in_flight)
            assert c1 == 200 and "[DONE]" not in events(streamed)
            error = json.loads(events(streamed)[-1])["error"]
            assert (error["code"], error["type"]) == (503, "service_unavailable")
            assert len(events(streamed)) > 2       # words, then the error
            assert c2 == 503 and json.loads(whole)["error"]["type"] == "service_unavailable"
            await until(lambda: proc.poll() is not None, timeout=10)
            code, log = exited(proc)
            assert code == 0 and "cutting 2 request(s)" in log, log
            await until(lambda: engine.aborted == 2)   # the decodes were told: vLLM aborts
        finally:
            terminate(proc, 5)
    run(scenario)


# --- the endpoint picker ---------------------------------------------------------------------

def headers() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path",
                                                                 value="/v1/completions")]),
        end_of_stream=True))


def response_end() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: [DONE]\n\n",
                                                          end_of_stream=True))


async def picked(call: Any) -> None:
    """The first exchange of a stream: request headers out, the pick back."""
    await call.write(headers())
    reply = await call.read()
    names = [h.header.key for h in reply.request_headers.response.header_mutation.set_headers]
    assert DESTINATION in names


async def health(channel: grpc.aio.Channel, service: str, expected: int | None = None
                 ) -> int | bool:  # fmt: skip
    """The gRPC health of ``service``, or whether it is ``expected``."""
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=2)
    return reply.status if expected is None else reply.status == expected


@pytest.fixture
def picker_ports() -> tuple[int, int]:
    return free_port(), free_port()


def start_picker(engine: SlowEngine, ports: tuple[int, int], delay: str, grace: str
                 ) -> subprocess.Popen[str]:  # fmt: skip
    return start(engine, "epp", "--port", str(ports[0]), "--metrics-port", str(ports[1]),
                 "--drain-delay-seconds", delay, "--drain-grace-seconds", grace)


async def serving(address: str) -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            return await health(channel, "readiness") == SERVING
    except grpc.aio.AioRpcError:
        return False


def test_a_picker_drains_on_sigterm(picker_ports: tuple[int, int]) -> None:
    async def scenario(engine: SlowEngine) -> None:
        address = f"127.0.0.1:{picker_ports[0]}"
        ready = f"http://127.0.0.1:{picker_ports[1]}/ready"
        proc = start_picker(engine, picker_ports, "3", "30")
        try:
            await until(lambda: serving(address), step=0.1)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = ep_grpc.ExternalProcessorStub(channel)
                open_stream = stub.Process()
                await picked(open_stream)         # a request whose answer is still streaming
                loop = asyncio.get_running_loop()
                signalled = loop.time()
                proc.send_signal(signal.SIGTERM)
                await until(lambda: health(channel, "readiness", NOT_SERVING), timeout=2)
                assert await health(channel, "liveness") == SERVING
                assert await status(ready) == 503
                # The delay: a new stream still gets its pick.
                late = stub.Process()
                await picked(late)
                await late.write(response_end())
                await late.read()
                await late.done_writing()
                assert await late.code() == grpc.StatusCode.OK
                await until(lambda: loop.time() - signalled > 3.5)
                assert not await serving(address)             # no new connection
                # The open stream goes on to its end.
                await open_stream.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
                await open_stream.read()
                await open_stream.write(response_end())
                assert (await open_stream.read()).response_body.response.body_mutation \
                    .streamed_response.end_of_stream
                await open_stream.done_writing()
                assert await open_stream.code() == grpc.StatusCode.OK
            await until(lambda: proc.poll() is not None, timeout=5)
            assert loop.time() - signalled < 15        # when it was done, not the grace
            code, log = exited(proc)
            assert code == 0 and "drained: 0 stream(s) cut" in log, log
        finally:
            terminate(proc, 5)
    run(scenario)


def test_a_picker_stream_that_outlasts_the_grace_is_cancelled(
        picker_ports: tuple[int, int]) -> None:
    async def scenario(engine: SlowEngine) -> None:
        address = f"127.0.0.1:{picker_ports[0]}"
        proc = start_picker(engine, picker_ports, "0.5", "1")
        try:
            await until(lambda: serving(address), step=0.1)
            async with grpc.aio.insecure_channel(address) as channel:
                call = ep_grpc.ExternalProcessorStub(channel).Process()
                await picked(call)
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(call.code(), timeout=10)
                assert code != grpc.StatusCode.OK     # the gateway fails the request
            await until(lambda: proc.poll() is not None, timeout=10)
            rc, log = exited(proc)
            assert rc == 0 and "cancelling 1 open stream(s)" in log, log
        finally:
            terminate(proc, 5)
    run(scenario)
