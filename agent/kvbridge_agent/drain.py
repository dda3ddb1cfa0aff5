"""``kvbridge drain``: a vLLM pod's preStop hook, which returns once the engine is idle.

Kubernetes sends SIGTERM right after a container's preStop hook returns, and vLLM stops at
SIGTERM: requests it runs are cut. kvbridge's router and endpoint picker stop sending new
requests to a pod the moment it is marked for deletion, so waiting here until the engine has
no request running or waiting lets every request it took finish, streams included. A prefill
also keeps the blocks of requests it answered until their decode has read them (usually well
under a second, at most its lease): ``--quiet`` is how long the engine must stay idle before
the hook returns. The engine's own Prometheus counters (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) say when it is idle; nothing else is asked of it.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
IDLE, TIMED_OUT, ENGINE_GONE = "idle", "timed out", "engine gone"


@dataclass(frozen=True)
class EngineLoad:
    """Requests an engine runs and holds in its queue (summed over its label sets)."""

    running: float
    waiting: float

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


def engine_load(metrics_text: str) -> EngineLoad:
    """The load a vLLM ``/metrics`` page states; a page without the gauges is an error."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in (RUNNING, WAITING):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    missing = [name for name in (RUNNING, WAITING) if name not in totals]
    if missing:
        raise ValueError(f"the engine's /metrics has no {' or '.join(missing)}")
    return EngineLoad(totals[RUNNING], totals[WAITING])


@dataclass(frozen=True)
class DrainResult:
    outcome: str
    waited_s: float
    last: EngineLoad | None


def drain(fetch: Callable[[], str], *, settle_s: float, quiet_s: float, timeout_s: float,
          interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> DrainResult:  # fmt: skip
    """Wait ``settle_s`` (requests already sent arrive), then until the engine has been idle
    for ``quiet_s``, at most ``timeout_s`` in all. An engine that no longer answers is done."""
    start = clock()
    sleep(settle_s)
    idle_since: float | None = None
    last: EngineLoad | None = None
    while True:
        now = clock()
        try:
            last = engine_load(fetch())
        except OSError:                      # the engine stopped already: nothing to wait for
            return DrainResult(ENGINE_GONE, now - start, last)
        idle_since = None if last.busy else (now if idle_since is None else idle_since)
        if idle_since is not None and now - idle_since >= quiet_s:
            return DrainResult(IDLE, now - start, last)
        if now - start >= timeout_s:
            return DrainResult(TIMED_OUT, now - start, last)
        sleep(interval_s)


def _run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/metrics"

    def fetch() -> str:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return response.read().decode()
        except urllib.error.URLError as exc:
            raise OSError(str(exc)) from exc

    result = drain(fetch, settle_s=args.settle, quiet_s=args.quiet, timeout_s=args.timeout)
    load = (f"; {result.last.running:g} running, {result.last.waiting:g} waiting"
            if result.last else "")
    # A preStop hook's output shows only in the kubelet's event when it fails; print anyway.
    print(f"kvbridge drain: {result.outcome} after {result.waited_s:.1f} s{load}",
          file=sys.stderr)
    return 0  # a failed hook only delays SIGTERM further: always let the pod go on


def add_drain_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="wait until the local vLLM engine is idle (a preStop hook)",
        description="Wait until the vLLM engine at --url has no request running or waiting\n"
        "and has stayed so for --quiet seconds, at most --timeout seconds; then return 0.\n"
        "Use it as the vLLM container's preStop hook with terminationGracePeriodSeconds\n"
        "above --timeout: kvbridge's router and picker send a terminating pod no new\n"
        "request, so the requests it holds finish before vLLM gets SIGTERM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the engine's OpenAI server (default %(default)s)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds to wait first, for requests already on their way "
                        "(default %(default)s)")
    p.add_argument("--quiet", type=float, default=2.0,
                   help="seconds the engine must stay idle; a prefill's decodes read its "
                        "answers' KV within them (default %(default)s)")
    p.add_argument("--timeout", type=float, default=50.0,
                   help="give up after this many seconds in all (default %(default)s)")
    p.set_defaults(func=_run)
