"""``kvbridge-router`` as a process, its own command line and serving (``__main__.main``:
signals, drain, listeners), with a fixed routing table in place of the KVTransfer watch, so
that a test of the process needs no API server (the watch is tested against one in
tests/e2e/test_router_engines.py).

    python _static_router.py TABLE_JSON [kvbridge-router arguments...]

TABLE_JSON: ``{"pairs": {decode: [prefill, ...]}, "engines": {id: [role, host, port]}}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvbridge_router import __main__ as cli
from kvbridge_router.table import Engine, RoutingTable


class StaticWatch:
    """The TransferWatch's surface, over a table that never changes."""

    table: RoutingTable

    def __init__(self, _api_client: Any, namespace: str, name: str, *,
                 follow_pods: bool = True) -> None:
        self.namespace, self.name, self.synced = namespace, name, True

    def start(self) -> StaticWatch:
        return self

    def stop(self) -> None:
        pass


def main() -> int:
    spec = json.loads(sys.argv[1])
    StaticWatch.table = RoutingTable(
        {d: tuple(ps) for d, ps in spec["pairs"].items()},
        {e: Engine(e, role, host, (f"pod-{e}",), port=port)
         for e, (role, host, port) in spec["engines"].items()})  # fmt: skip
    cli.TransferWatch = StaticWatch  # type: ignore[misc,assignment]
    import kvbridge_agent.kube

    kvbridge_agent.kube.api_client = lambda _kubeconfig=None: None  # type: ignore[assignment]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
