"""A node simulator for the local control plane (:class:`FakeKubelet`): Ready Nodes, and pods
bound, marked Running with a podIP and deleted as a kubelet would, with no container run.

Threads: one daemon thread with a pod watch (reconnecting on expiry); ``stop()`` sets an event
and closes the watch.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any


class FakeKubelet:
    """Registers Ready Nodes and moves pods through their life as a kubelet would.

    - Nodes ``nodes`` (name -> labels) are created Ready.
    - A Pending pod without ``spec.nodeName`` is bound to the first node whose labels satisfy
      its ``nodeSelector`` (round robin), then marked Running/Ready with a podIP.
    - A pod with a deletionTimestamp is deleted with grace period 0 (the kubelet's job).
    """

    def __init__(self, api_client: Any, nodes: Mapping[str, Mapping[str, str]] | None = None):
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._nodes = dict(nodes or {"node-a": {}})
        self._stop = threading.Event()
        self._rr = itertools.count()
        self._ips = (f"10.244.{i // 250}.{i % 250 + 2}" for i in itertools.count())
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._watch: Any = None

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FakeKubelet:
        for name, labels in self._nodes.items():
            self._register_node(name, labels)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=10)

    def _register_node(self, name: str, labels: Mapping[str, str]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        }
        with contextlib.suppress(ApiException):
            self._core.create_node(body)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._core.patch_node_status(
            name,
            {
                "status": {
                    "conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady",
                         "message": "fake kubelet", "lastHeartbeatTime": now,
                         "lastTransitionTime": now}
                    ],
                    "capacity": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
                    "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
                }
            },
        )  # fmt: skip

    def _loop(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                self._watch = watch.Watch()
                for ev in self._watch.stream(
                    self._core.list_pod_for_all_namespaces, timeout_seconds=60
                ):
                    if self._stop.is_set():
                        return
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._handle(ev["object"])
            except Exception:
                if self._stop.wait(0.5):
                    return

    def _handle(self, pod: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        meta, spec, status = pod.metadata, pod.spec, pod.status
        try:
            if meta.deletion_timestamp is not None:
                self._core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
                return
            if not spec.node_name:
                node = self._pick_node(spec.node_selector or {})
                if node is None:
                    return
                self._core.create_namespaced_binding(
                    meta.namespace,
                    {
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": meta.name},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                    },
                    _preload_content=False,
                )
                return
            if spec.node_name in self._nodes and (status.phase != "Running" or not status.pod_ip):
                self._mark_running(pod)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _pick_node(self, selector: Mapping[str, str]) -> str | None:
        fits = [
            n for n, labels in self._nodes.items()
            if all({"kubernetes.io/hostname": n, **labels}.get(k) == v for k, v in selector.items())
        ]  # fmt: skip
        return fits[next(self._rr) % len(fits)] if fits else None

    def _mark_running(self, pod: Any) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ]
        containers = [
            {"name": c.name, "image": c.image, "imageID": "", "ready": True, "started": True,
             "restartCount": 0, "state": {"running": {"startedAt": now}}}
            for c in pod.spec.containers
        ]  # fmt: skip
        self._core.patch_namespaced_pod_status(
            pod.metadata.name,
            pod.metadata.namespace,
            {
                "status": {
                    "phase": "Running",
                    "podIP": next(self._ips),
                    "hostIP": "127.0.0.1",
                    "startTime": now,
                    "conditions": ready,
                    "containerStatuses": containers,
                }
            },
        )
