"""Following one KVTransfer and the KVEndpoints of its namespace through the API server.

Threads: one per resource (KVTransfers, KVEndpoints), each listing and then watching from
the list's resourceVersion; a watch that ends or fails (410 Gone after a compaction, the API
server restarting) is followed by a new list. After every change the thread computes a new
routing table (table.py) and replaces ``self.table``: readers take the reference and never
see a half-applied change. The router's ServiceAccount needs only get, list and watch on the
two resources in its namespace.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvbridge_agent.resources import ENDPOINTS, GROUP, TRANSFERS, VERSION

from .table import RoutingTable, routing_table

log = logging.getLogger("kvbridge.router.watch")

WATCH_TIMEOUT_S = 60
RETRY_S = 1.0


class TransferWatch:
    """The routing table of KVTransfer ``namespace/name``, kept current."""

    def __init__(self, api_client: Any, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.api_client = api_client
        self.table = RoutingTable(reason="the KVTransfer and its KVEndpoints are not listed yet")
        self._transfers: dict[str, dict[str, Any]] = {}
        self._endpoints: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listed: set[str] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> TransferWatch:
        for plural, store in ((TRANSFERS, self._transfers),
                              (ENDPOINTS, self._endpoints)):  # fmt: skip
            t = threading.Thread(target=self._follow, args=(plural, store), daemon=True,
                                 name=f"kvbridge-router-{plural}")
            t.start()
            self._threads.append(t)
        return self

    @property
    def synced(self) -> bool:
        """True once both resources were listed (the table reflects the API server)."""
        return len(self._listed) == 2

    def stop(self) -> None:
        self._stop.set()

    def _follow(self, plural: str, store: dict[str, dict[str, Any]]) -> None:
        from kubernetes import client, watch

        api = client.CustomObjectsApi(self.api_client)
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                           plural)  # fmt: skip
                with self._lock:
                    store.clear()
                    store.update({o["metadata"]["name"]: o for o in listed["items"]})
                    self._listed.add(plural)
                self._recompute()
                stream = watch.Watch().stream(
                    api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, plural,
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=WATCH_TIMEOUT_S, allow_watch_bookmarks=True)
                for event in stream:
                    if self._stop.is_set():
                        return
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":        # 410 Gone and friends: list again
                        break
                    if kind == "BOOKMARK":
                        continue
                    with self._lock:
                        if kind == "DELETED":
                            store.pop(obj["metadata"]["name"], None)
                        else:
                            store[obj["metadata"]["name"]] = obj
                    self._recompute()
            except Exception as exc:  # the API server away, a dropped connection: list again
                log.warning("watching %s in %s: %s; listing again in %.0f s", plural,
                            self.namespace, exc, RETRY_S)
                self._stop.wait(RETRY_S)

    def _recompute(self) -> None:
        with self._lock:
            if len(self._listed) < 2:
                return
            table = routing_table(self.name, self._transfers.get(self.name),
                                  list(self._endpoints.values()))  # fmt: skip
            changed = table != self.table
            self.table = table
        if changed:
            log.info("routing table: %d verified pair(s)%s", table.pair_count(),
                     f" ({table.reason})" if table.reason else "")
