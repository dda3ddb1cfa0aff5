"""``kvbridge-router``: the P/D router for one KVTransfer (see the package docstring)."""

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
from .proxy import Router, RouterSettings
from .watch import TransferWatch

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _namespace(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SA_NAMESPACE.exists():
        return SA_NAMESPACE.read_text().strip()
    raise SystemExit("kvbridge-router: --namespace is required outside a pod")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = RouterSettings()
    p = argparse.ArgumentParser(
        prog="kvbridge-router",
        description="OpenAI-compatible P/D router: every request takes a prefill/decode pair "
        "that the kvbridge operator paired and the decode verified with a handshake.")
    p.add_argument("--transfer", required=True, help="the KVTransfer whose engines to route to")
    p.add_argument("--namespace", help="its namespace (default: the pod's)")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--engine-port", type=int, default=defaults.engine_port,
                   help="the engines' OpenAI port (default %(default)s)")
    p.add_argument("--lease-seconds", type=float, default=defaults.lease_s,
                   help="the prefills' kv_lease_duration (default %(default)s, vLLM's)")
    p.add_argument("--lease-margin-seconds", type=float, default=defaults.lease_margin_s,
                   help="forward a prefill answer only while it is younger than the lease "
                   "minus this (default %(default)s)")
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG, else the pod's token")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.lease_margin_seconds >= args.lease_seconds:
        p.error(f"--lease-margin-seconds: expected less than --lease-seconds "
                f"({args.lease_seconds:g}), got {args.lease_margin_seconds:g}")
    return args


async def serve(args: argparse.Namespace) -> None:
    from kvbridge_agent.kube import api_client

    namespace = _namespace(args.namespace)
    m.INFO.labels(namespace, args.transfer).set(1)
    m.init_series()
    watch = TransferWatch(api_client(args.kubeconfig), namespace, args.transfer).start()
    settings = RouterSettings(engine_port=args.engine_port, lease_s=args.lease_seconds,
                              lease_margin_s=args.lease_margin_seconds)
    router = Router(lambda: watch.table, settings)
    # A client that goes away cancels its handler: the decode connection closes with it.
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logging.getLogger("kvbridge.router").info(
        "routing KVTransfer %s/%s on %s:%d", namespace, args.transfer, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watch.stop()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
