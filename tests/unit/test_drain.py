"""``kvbridge drain`` (the vLLM pods' preStop hook): it reads the engine's own gauges and
returns once the engine has stayed idle, at its timeout, or when the engine is gone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvbridge_agent.cli import main
from kvbridge_agent.drain import ENGINE_GONE, IDLE, TIMED_OUT, drain, engine_load


def page(running: float, waiting: float) -> str:
    """A /metrics page as vLLM 0.30 writes it (one label set per engine)."""
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_engine_load_sums_label_sets_and_names_a_missing_gauge() -> None:
    text = page(2, 1) + 'vllm:num_requests_running{engine="1",model_name="m"} 3\n'
    load = engine_load(text)
    assert (load.running, load.waiting, load.busy) == (5, 1, True)
    assert not engine_load(page(0, 0)).busy
    with pytest.raises(ValueError, match="vllm:num_requests_waiting"):
        engine_load(page(0, 0).split("# HELP vllm:num_requests_waiting")[0])


def test_drain_waits_for_the_engine_to_stay_idle() -> None:
    clock = FakeClock()
    loads = iter([page(2, 1), page(1, 0), page(0, 0), page(0, 1), page(0, 0), page(0, 0),
                  page(0, 0), page(0, 0), page(0, 0)])
    result = drain(lambda: next(loads), settle_s=2, quiet_s=1.0, timeout_s=30,
                   clock=clock, sleep=clock.sleep)  # fmt: skip
    # settle 2 s, then busy at 2.0, 2.5, idle 3.0, busy 3.5 (a request arrived), idle from
    # 4.0: done at 5.0
    assert (result.outcome, result.waited_s) == (IDLE, 5.0)


def test_drain_gives_up_at_its_timeout_and_ends_when_the_engine_is_gone() -> None:
    clock = FakeClock()
    result = drain(lambda: page(1, 0), settle_s=1, quiet_s=1, timeout_s=4,
                   clock=clock, sleep=clock.sleep)  # fmt: skip
    assert (result.outcome, result.waited_s, result.last.running) == (TIMED_OUT, 4.0, 1)

    def refused() -> str:
        raise ConnectionRefusedError("connection refused")

    clock = FakeClock()
    result = drain(refused, settle_s=1, quiet_s=1, timeout_s=4, clock=clock, sleep=clock.sleep)
    assert (result.outcome, result.waited_s) == (ENGINE_GONE, 1.0)


@pytest.fixture
def engine() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server serving the /metrics pages in the list, one per request (the last
    repeats), as an engine winding down would."""
    pages: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (pages.pop(0) if len(pages) > 1 else pages[0]).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pages
    server.shutdown()


def test_the_command_returns_once_the_engine_is_idle(engine: tuple[str, list[str]],
                                                    capsys: pytest.CaptureFixture) -> None:
    url, pages = engine
    pages.extend([page(1, 0), page(1, 0), page(0, 0)])
    assert main(["drain", "--url", url, "--settle", "0", "--quiet", "0.2",
                 "--timeout", "20"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("kvbridge drain: idle after ") and "0 running, 0 waiting" in err
    assert main(["drain", "--url", "http://127.0.0.1:9", "--settle", "0"]) == 0
    assert "engine gone" in capsys.readouterr().err
