"""Following one KVTransfer, the KVEndpoints and the Pods of its namespace through the API
server.

Threads: one per resource (KVTransfers, KVEndpoints, Pods), each listing and then watching
from the list's resourceVersion; a watch that ends or fails (410 Gone after a compaction, the
API server restarting) is followed by a new list. After every change the thread computes a new
routing table (table.py) and replaces ``self.table``: readers take the reference and never
see a half-applied change. The router's ServiceAccount needs get, list and watch on the two
kvbridge resources and on pods in its namespace. Without the pods permission the router still
serves, choosing pairs by their KVEndpoints alone (it logs the missing permission): a pair
whose pod is terminating or not Ready then keeps taking requests until its endpoints go.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.resources import ENDPOINTS, GROUP, TRANSFERS, VERSION

from .pod_state import PodState, pod_state
from .table import RoutingTable, routing_table

log = logging.getLogger("kvbridge.router.watch")

WATCH_TIMEOUT_S = 60
RETRY_S = 1.0
#: how long to wait before asking again for pods the router may not list (403)
FORBIDDEN_RETRY_S = 60.0
PODS = "pods"


@dataclass(frozen=True)
class _Resource:
    """One followed resource: how to list it and what to keep of each object."""

    plural: str
    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    keep: Callable[[Any], Any]


class TransferWatch:
    """The routing table of KVTransfer ``namespace/name``, kept current."""

    def __init__(self, api_client: Any, namespace: str, name: str, *,
                 follow_pods: bool = True) -> None:
        self.namespace, self.name = namespace, name
        self.follow_pods = follow_pods
        self.api_client = api_client
        self.table = RoutingTable(reason="the KVTransfer and its KVEndpoints are not listed yet")
        self._stores: dict[str, dict[str, Any]] = {TRANSFERS: {}, ENDPOINTS: {}}
        if follow_pods:
            self._stores[PODS] = {}
        #: False while the router may not list pods (then only the endpoints decide)
        self._pods_readable = follow_pods
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listed: set[str] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> TransferWatch:
        for resource in self._resources():
            t = threading.Thread(target=self._follow, args=(resource,), daemon=True,
                                 name=f"kvbridge-router-{resource.plural}")
            t.start()
            self._threads.append(t)
        return self

    def _resources(self) -> list[_Resource]:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api_client).list_namespaced_custom_object
        pods = client.CoreV1Api(self.api_client).list_namespaced_pod
        serialise = self.api_client.sanitize_for_serialization
        followed = [
            _Resource(TRANSFERS, custom, (GROUP, VERSION, self.namespace, TRANSFERS), dict),
            _Resource(ENDPOINTS, custom, (GROUP, VERSION, self.namespace, ENDPOINTS), dict),
            _Resource(PODS, pods, (self.namespace,), lambda p: pod_state(serialise(p))),
        ]
        return [r for r in followed if r.plural in self._stores]

    @property
    def synced(self) -> bool:
        """True once every resource was listed (the table reflects the API server)."""
        return len(self._listed) == len(self._stores)

    def stop(self) -> None:
        self._stop.set()

    def _follow(self, r: _Resource) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        store = self._stores[r.plural]
        while not self._stop.is_set():
            try:
                listed = r.list_fn(*r.args)
                items = listed["items"] if isinstance(listed, dict) else listed.items
                version = (listed["metadata"]["resourceVersion"] if isinstance(listed, dict)
                           else listed.metadata.resource_version)  # fmt: skip
                with self._lock:
                    store.clear()
                    store.update({_name(o): r.keep(o) for o in items})
                    self._listed.add(r.plural)
                    if r.plural == PODS:
                        self._pods_readable = True
                self._recompute()
                stream = watch.Watch().stream(r.list_fn, *r.args, resource_version=version,
                                              timeout_seconds=WATCH_TIMEOUT_S,
                                              allow_watch_bookmarks=True)  # fmt: skip
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
                            store.pop(_name(obj), None)
                        else:
                            store[_name(obj)] = r.keep(obj)
                    self._recompute()
            except ApiException as exc:
                if r.plural == PODS and exc.status == 403:
                    self._pods_forbidden()
                    continue
                log.warning("watching %s in %s: %s; listing again in %.0f s", r.plural,
                            self.namespace, exc, RETRY_S)
                self._stop.wait(RETRY_S)
            except Exception as exc:  # the API server away, a dropped connection: list again
                log.warning("watching %s in %s: %s; listing again in %.0f s", r.plural,
                            self.namespace, exc, RETRY_S)
                self._stop.wait(RETRY_S)

    def _pods_forbidden(self) -> None:
        """Serve on the endpoints alone, say so, and ask again later (RBAC may be fixed)."""
        with self._lock:
            first = self._pods_readable or PODS not in self._listed
            self._pods_readable = False
            self._stores[PODS].clear()
            self._listed.add(PODS)
        if first:
            log.error("the router may not list pods in %s (its Role needs get, list and watch "
                      "on pods): pairs whose pod is terminating or not Ready keep taking "
                      "requests until their KVEndpoints go; asking again every %.0f s",
                      self.namespace, FORBIDDEN_RETRY_S)
        self._recompute()
        self._stop.wait(FORBIDDEN_RETRY_S)

    def _recompute(self) -> None:
        with self._lock:
            if not self.synced:
                return
            # None: pods not followed (a sidecar) or not readable; the endpoints decide alone.
            # The table is computed under the lock, so the store is read as it is, not copied.
            pods: dict[str, PodState] | None = (self._stores[PODS] if self._pods_readable
                                                else None)  # fmt: skip
            table = routing_table(self.name, self._stores[TRANSFERS].get(self.name),
                                  list(self._stores[ENDPOINTS].values()), pods)  # fmt: skip
            changed = table != self.table
            previous, self.table = self.table, table
        if changed:
            log.info("routing table: %d verified pair(s)%s", table.pair_count(),
                     f" ({table.reason})" if table.reason else "")
            for engine, why in sorted(table.held.items()):
                if previous.held.get(engine) != why:
                    log.info("engine %s takes no new request: %s", engine, why)


def _name(obj: Any) -> str:
    return obj["metadata"]["name"] if isinstance(obj, dict) else obj.metadata.name
