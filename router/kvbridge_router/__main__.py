"""``kvbridge-router``: the P/D router for one KVTransfer (see the package docstring), and its
two gateway forms from the same image:

- ``kvbridge-router --transfer NAME``: the OpenAI-compatible router;
- ``kvbridge-router epp --transfer NAME``: the endpoint picker of an InferencePool (ext_proc);
- ``kvbridge-router sidecar --transfer NAME``: the P/D sidecar of a decode pod.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from . import metrics as m
from .affinity import TrackingSettings
from .balance import POLICIES, ChooserSettings
from .drain import Drain, DrainSettings
from .proxy import Router, RouterSettings
from .sidecar import PREFILL_HEADERS, WITHOUT_HEADER, Sidecar, SidecarSettings
from .watch import TransferWatch

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MODES = ("router", "epp", "sidecar")


def _namespace(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SA_NAMESPACE.exists():
        return SA_NAMESPACE.read_text().strip()
    raise SystemExit("kvbridge-router: --namespace is required outside a pod")


def _common(p: argparse.ArgumentParser, port: int) -> None:
    defaults = RouterSettings()
    p.add_argument("--transfer", required=True, help="the KVTransfer whose engines to route to")
    p.add_argument("--namespace", help="its namespace (default: the pod's)")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=port, help="listen port (default %(default)s)")
    p.add_argument("--engine-port", type=int, default=defaults.engine_port,
                   help="the engines' OpenAI port where their KVEndpoint states none "
                   "(default %(default)s)")
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG, else the pod's token")
    p.add_argument("--log-level", default="INFO")


def _drain(p: argparse.ArgumentParser, what: str) -> None:
    defaults = DrainSettings()
    g = p.add_argument_group("draining on SIGTERM (docs/operations.md)")
    g.add_argument("--drain-delay-seconds", type=float, default=defaults.delay_s,
                   help=f"from SIGTERM, how long readiness is false while {what} are still "
                   "taken, so that the Service stops sending before the listener closes "
                   "(default %(default)s)")
    g.add_argument("--drain-grace-seconds", type=float, default=defaults.grace_s,
                   help=f"then, how long {what} in flight get to finish; those still open "
                   "are cut with an error (default %(default)s)")


def _lease(p: argparse.ArgumentParser) -> None:
    defaults = RouterSettings()
    p.add_argument("--lease-seconds", type=float, default=defaults.lease_s,
                   help="the prefills' kv_lease_duration (default %(default)s, vLLM's)")
    p.add_argument("--lease-margin-seconds", type=float, default=defaults.lease_margin_s,
                   help="forward a prefill answer only while it is younger than the lease "
                   "minus this (default %(default)s)")


def _front_door(p: argparse.ArgumentParser) -> None:
    defaults = RouterSettings()
    p.add_argument("--header-timeout-seconds", type=float, default=defaults.header_timeout_s,
                   help="a connection's time to send a complete request line and headers, "
                   "and the idle keep-alive timeout (default %(default)s)")
    p.add_argument("--body-timeout-seconds", type=float, default=defaults.body_timeout_s,
                   help="a request's time to send its whole body once its headers arrived; "
                   "408 past it (default %(default)s)")


def _choice(p: argparse.ArgumentParser) -> None:
    chooser, tracking = ChooserSettings(), TrackingSettings()
    g = p.add_argument_group("pair choice (docs/routing.md)")
    g.add_argument("--policy", choices=POLICIES, default=chooser.policy,
                   help="least-load: the least busy decode, then its least busy prefill; "
                   "cache-aware: the pair with the lowest estimated cost (prefix-cache hits, "
                   "load, transfer) (default %(default)s)")
    g.add_argument("--prefill-ms-per-block", type=float, default=chooser.prefill_ms_per_block,
                   help="cache-aware: what a prefill spends on one block of prompt it does not "
                   "hold (default %(default)s)")
    g.add_argument("--queue-ms", type=float, default=chooser.queue_ms,
                   help="cache-aware: what one request already at a prefill adds "
                   "(default %(default)s)")
    g.add_argument("--pull-ms-per-block", type=float, default=chooser.pull_ms_per_block,
                   help="cache-aware: what a decode spends on one block it must pull, beyond "
                   "the wire time (default %(default)s)")
    g.add_argument("--decode-queue-ms", type=float, default=chooser.decode_queue_ms,
                   help="cache-aware: what one request already at a decode adds "
                   "(default %(default)s)")
    g.add_argument("--eviction-weight", type=float, default=chooser.eviction_weight,
                   help="cache-aware: what evicting one block from an engine whose cache is "
                   "full costs, in blocks of its work (a prefill's compute, a decode's pull: "
                   "what it is likely to cause a later prompt); 0: evictions are free "
                   "(default %(default)s)")
    g.add_argument("--balance-factor", type=float, default=chooser.balance_factor,
                   help="cache-aware: no engine above this multiple of its role's mean "
                   "queue while another is below it (default %(default)s)")
    g.add_argument("--balance-slack", type=float, default=chooser.balance_slack,
                   help="cache-aware: ... and more than this many requests above it, so that "
                   "a small mean does not forbid a second request to the engine holding a "
                   "prefix (default %(default)s)")
    g.add_argument("--transport-gbps", default="",
                   help="cache-aware: throughput per transport for the transfer estimate, "
                   "e.g. 'tcp=1.2,cma=9' (defaults: tcp 1, shared memory 10, RDMA 20, "
                   "cuda_ipc 100)")
    g.add_argument("--kv-events-port", type=int, default=tracking.kv_events_port,
                   help="cache-aware: the port of the engines' KV-event publishers where "
                   "their KVEndpoints state none (kvbridge's connector publishes the port of "
                   "vLLM's --kv-events-config); engines with events give precise tracking, "
                   "none at all approximate, from the prompts' text (default %(default)s: "
                   "only the KVEndpoints' ports)")
    g.add_argument("--load-interval-seconds", type=float, default=tracking.load_interval_s,
                   help="cache-aware: how often each engine's /metrics is read "
                   "(default %(default)s)")
    g.add_argument("--chars-per-token", type=float, default=tracking.chars_per_token,
                   help="cache-aware, approximate: characters of prompt text per token "
                   "(default %(default)s)")


def _gbps(text: str, p: argparse.ArgumentParser) -> dict[str, float]:
    out = dict(ChooserSettings().transport_gbps)
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            p.error(f"--transport-gbps: expected NAME=GBPS[,NAME=GBPS...], got {item!r}")
        if out[name.strip()] <= 0:
            p.error(f"--transport-gbps: {name.strip()}: expected a rate > 0, got {value}")
    return out


def _choice_settings(args: argparse.Namespace, p: argparse.ArgumentParser
                     ) -> tuple[ChooserSettings, TrackingSettings]:  # fmt: skip
    try:
        chooser = ChooserSettings(
            policy=args.policy, prefill_ms_per_block=args.prefill_ms_per_block,
            queue_ms=args.queue_ms, pull_ms_per_block=args.pull_ms_per_block,
            decode_queue_ms=args.decode_queue_ms, eviction_weight=args.eviction_weight,
            balance_factor=args.balance_factor, balance_slack=args.balance_slack,
            transport_gbps=_gbps(args.transport_gbps, p))
    except ValueError as exc:
        p.error(f"--{str(exc).replace('_', '-')}")
    if args.load_interval_seconds <= 0:
        p.error(f"--load-interval-seconds: expected > 0, got {args.load_interval_seconds}")
    if args.chars_per_token <= 0:
        p.error(f"--chars-per-token: expected > 0, got {args.chars_per_token}")
    if not 0 <= args.kv_events_port <= 65535:
        p.error(f"--kv-events-port: expected 0 to 65535, got {args.kv_events_port}")
    return chooser, TrackingSettings(args.kv_events_port, args.load_interval_seconds,
                                     args.chars_per_token)  # fmt: skip


def _settings(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(engine_port=args.engine_port, lease_s=args.lease_seconds,
                          lease_margin_s=args.lease_margin_seconds,
                          header_timeout_s=args.header_timeout_seconds,
                          body_timeout_s=args.body_timeout_seconds,
                          **({"chooser": args.chooser, "tracking": args.tracking}
                             if args.mode == "router" else {}))  # fmt: skip


def _prefill_headers(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--prefill-header", action="append", dest="prefill_headers",
                   help=f"the request header(s) {verb} the prefill's host:port; repeat "
                   f"for several (default: {', '.join(PREFILL_HEADERS)})")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in MODES[1:] else "router"
    if mode == "epp":
        p = argparse.ArgumentParser(
            prog="kvbridge-router epp",
            description="Endpoint picker of an InferencePool (Envoy ext_proc, the Gateway API "
            "Inference Extension's protocol): names a decode of a verified pair as the "
            "destination and its prefill in a header for the decode's sidecar.")
        _common(p, 9002)
        p.add_argument("--metrics-port", type=int, default=9090,
                       help="HTTP port of /metrics and /health (default %(default)s)")
        p.add_argument("--target-port", type=int, default=8000,
                       help="the InferencePool's target port on decode pods, where their "
                       "sidecar listens (default %(default)s)")
        _prefill_headers(p, "that name")
        _drain(p, "ext_proc streams (requests)")
        _choice(p)
    elif mode == "sidecar":
        p = argparse.ArgumentParser(
            prog="kvbridge-router sidecar",
            description="P/D sidecar of a decode pod: calls the verified prefill the endpoint "
            "picker named, then this pod's vLLM.")
        _common(p, 8000)
        _lease(p)
        _front_door(p)
        p.add_argument("--pod-name", default=os.environ.get("POD_NAME"),
                       help="this decode's pod (default: $POD_NAME)")
        p.add_argument("--decode-url", default="http://127.0.0.1:8200",
                       help="this pod's vLLM OpenAI server (default %(default)s)")
        p.add_argument("--without-prefill-header", choices=WITHOUT_HEADER, default="refuse",
                       help="a request that names no prefill: refuse it (400, the default) or "
                       "serve it from this pod's engine alone (local)")
        _prefill_headers(p, "to read")
        _drain(p, "requests")
    else:
        p = argparse.ArgumentParser(
            prog="kvbridge-router",
            description="OpenAI-compatible P/D router: every request takes a prefill/decode "
            "pair that the kvbridge operator paired and the decode verified with a handshake. "
            "Also: 'kvbridge-router epp --help' (the InferencePool endpoint picker) and "
            "'kvbridge-router sidecar --help' (the decode pod's P/D sidecar).")
        _common(p, 8080)
        _lease(p)
        _front_door(p)
        _drain(p, "requests")
        _choice(p)
    args = p.parse_args(argv)
    args.mode = mode
    try:
        args.drain = DrainSettings(args.drain_delay_seconds, args.drain_grace_seconds)
    except ValueError as exc:
        p.error(f"--{str(exc).replace('_', '-')}")
    if mode != "sidecar":
        args.chooser, args.tracking = _choice_settings(args, p)
    if mode != "epp" and args.lease_margin_seconds >= args.lease_seconds:
        p.error(f"--lease-margin-seconds: expected less than --lease-seconds "
                f"({args.lease_seconds:g}), got {args.lease_margin_seconds:g}")
    if mode == "sidecar" and not args.pod_name:
        p.error("--pod-name: required (or $POD_NAME, from the downward API)")
    if mode != "router":
        args.prefill_headers = tuple(args.prefill_headers or PREFILL_HEADERS)
    return args


async def _until_signalled(again: asyncio.Event | None = None) -> asyncio.Event:
    """Until SIGTERM or SIGINT; the event returned (``again``) is set by the next one (the
    drain's ``hurry``: a second signal ends the drain at once)."""
    first, again = asyncio.Event(), again or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: (again if first.is_set() else first).set())
    await first.wait()
    return again


async def _serve_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    # A client that goes away cancels its handler: the decode connection closes with it.
    # Requests are drained before the runner's cleanup (drain.py), which then waits little.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve(args: argparse.Namespace) -> None:
    from kvbridge_agent.kube import api_client

    namespace = _namespace(args.namespace)
    m.INFO.labels(namespace, args.transfer).set(1)
    m.init_series()
    # The sidecar checks the prefill the picker chose for its own decode: pods are the
    # picker's business (it holds pairs of terminating or unready pods back).
    watch = TransferWatch(api_client(args.kubeconfig), namespace, args.transfer,
                          follow_pods=args.mode != "sidecar").start()
    log = logging.getLogger("kvbridge.router")
    if args.mode == "epp":
        await _serve_picker(args, watch)
    else:
        settings = _settings(args)
        if args.mode == "sidecar":
            router: Router = Sidecar(lambda: watch.table, settings, SidecarSettings(
                args.pod_name, args.decode_url.rstrip("/"), args.prefill_headers,
                args.without_prefill_header))
        else:
            router = Router(lambda: watch.table, settings)
        drain = Drain(args.drain)
        runner = await _serve_http(drain.install(router.app(), router.health), args.host,
                                   args.port)  # fmt: skip
        log.info("%s for KVTransfer %s/%s on %s:%d", args.mode, namespace, args.transfer,
                 args.host, args.port)
        hurry = await _until_signalled()
        await drain.shut_down(runner, hurry)
    watch.stop()


async def _serve_picker(args: argparse.Namespace, watch: TransferWatch) -> None:
    from .extproc import EndpointPicker, serve_grpc
    from .picker import PickerSettings

    picker = EndpointPicker(lambda: watch.table, PickerSettings(
        target_port=args.target_port, engine_port=args.engine_port,
        prefill_headers=args.prefill_headers), args.chooser, args.tracking)
    await picker.start()
    # /metrics and /health over HTTP, as the router serves them, and /ready: gRPC readiness
    # (for Kubernetes < 1.24, which has no gRPC probes).
    status = Router(lambda: watch.table, RouterSettings(engine_port=args.engine_port))
    app = status.status_app()

    async def ready(_request: web.Request) -> web.Response:
        why = "draining" if picker.draining else "" if watch.synced else "not listed yet"
        return web.json_response({"status": why or "ok"}, status=503 if why else 200)

    app.router.add_get("/ready", ready)
    runner = await _serve_http(app, args.host, args.metrics_port)
    stop, hurry = asyncio.Event(), asyncio.Event()
    grpc_task = asyncio.create_task(serve_grpc(
        picker, f"{args.host}:{args.port}", lambda: watch.synced, stop, args.drain, hurry))
    logging.getLogger("kvbridge.picker").info(
        "endpoint picker for KVTransfer %s/%s: ext_proc on %s:%d, metrics on :%d, decodes' "
        "target port %d", watch.namespace, args.transfer, args.host, args.port,
        args.metrics_port, args.target_port)
    signalled = asyncio.create_task(_until_signalled(hurry))
    await asyncio.wait({grpc_task, signalled}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    stop.set()
    await grpc_task
    await picker.close()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
