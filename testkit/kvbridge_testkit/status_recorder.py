"""Every KVEndpoint status the API server stores, in order, from a watch: what the leader
election tests (e2e and the soak) hold to "no status goes backwards"."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client, watch

from kvbridge_operator.config import ENDPOINTS, GROUP, VERSION

#: status fields that never decrease for one endpoint (a stale leader's write would)
MONOTONIC = ("observedGeneration", "observedEpoch")


class StatusRecorder(threading.Thread):
    """Every KVEndpoint status in ``ns`` the API server stores, in order, from a watch:
    ``seen[name]`` is a list of (monotonic time, status)."""

    def __init__(self, api_client: Any, ns: str) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api_client)
        self.ns = ns
        self.seen: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        self.stopping = threading.Event()
        self.version = ""

    def run(self) -> None:
        while not self.stopping.is_set():
            kw = {"resource_version": self.version} if self.version else {}
            for event in watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP,
                                              VERSION, self.ns, ENDPOINTS, timeout_seconds=2,
                                              allow_watch_bookmarks=False, **kw):  # fmt: skip
                obj = event["object"]
                self.version = obj["metadata"]["resourceVersion"]
                status = {k: v for k, v in (obj.get("status") or {}).items() if k != "handshakes"}
                history = self.seen.setdefault(obj["metadata"]["name"], [])
                if not history or history[-1][1] != status:
                    history.append((time.monotonic(), status))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


def backwards(seen: dict[str, list[tuple[float, dict[str, Any]]]]) -> list[str]:
    """Each endpoint whose ``MONOTONIC`` fields ever decreased, with the values."""
    out = []
    for name, history in seen.items():
        for key in MONOTONIC:
            values = [s[key] for _, s in history if key in s]
            if values != sorted(values):
                out.append(f"{name}: {key} {values}")
    return out
