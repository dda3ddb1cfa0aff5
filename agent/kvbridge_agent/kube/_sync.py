"""Follow this rank's KVEndpoint: assigned peers in, handshake results out (flows 2, 4, 6).

One daemon thread reads the KVEndpoint every ``interval_s`` (the chart's agent Role grants
``get`` on kvendpoints, not ``list``/``watch``, so this polls one object by name; a GET of one
small object per second per pod is cheap). On every read it:

1. re-publishes the spec if the object vanished or its spec is not ours (keeps it current);
2. takes ``status.peers`` when the operator's verdict refers to our epoch
   (``status.observedEpoch``), and hands them to :meth:`AgentService.set_peers`, which drops
   peers that went away or changed epoch and handshakes with new ones; failed handshakes are
   retried with a bounded backoff;
3. writes ``status.handshakes`` when the reports changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .. import metrics
from ..resources import (
    ENDPOINT_FIELDS,
    ENDPOINT_STATUS_FIELDS,
    HANDSHAKE_FIELDS,
    SPEC,
    STATUS,
    HandshakeState,
)
from ._document import endpoint_spec
from ._publisher import EndpointPublisher, PublishError

if TYPE_CHECKING:
    from ..identity import ModelIdentity

log = logging.getLogger("kvbridge.agent.kube")


class EndpointSync:
    """Publishes ``service``'s KVEndpoint and keeps its peers in sync; see module docstring.

    Args:
        service: a started :class:`~kvbridge_agent.service.AgentService`.
        publisher: the :class:`EndpointPublisher` for this pod.
        transfer: the KVTransfer name the endpoint belongs to.
        interval_s: period of the status read.
        retry_max_s: cap of the backoff between retries of failed handshakes.
        on_change: called with the reports after every handshake round (tests, the demo).
        identity: the model the engine serves, published in ``spec.model`` and
            ``spec.versions`` (None: those are left out).
    """

    def __init__(self, service: Any, publisher: EndpointPublisher, transfer: str, *,
                 interval_s: float = 1.0, retry_max_s: float = 10.0,
                 on_change: Callable[[list[Any]], None] | None = None,
                 identity: ModelIdentity | None = None) -> None:
        self.service = service
        self.publisher = publisher
        self.transfer = transfer
        self.interval_s = float(interval_s)
        self.retry_max_s = float(retry_max_s)
        self.on_change = on_change
        self.identity = identity
        self.spec: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_peers: list[Mapping[str, Any]] | None = None
        self._retry_at = 0.0
        self._backoff = 0.5
        self.rounds = 0
        self.errors = 0

    def publish(self) -> dict[str, Any]:
        """Publish the spec once (new epoch above any stored one). Call before :meth:`start`."""
        pod = self.publisher.pod
        epoch = self.publisher.next_epoch(self.service.epoch)
        if epoch != self.service.epoch:
            raise PublishError(
                f"KVEndpoint {pod.namespace}/{self.publisher.name} already has epoch "
                f">= {self.service.epoch}; start the agent with a newer epoch "
                f"(AgentSettings.epoch={epoch})")
        self.spec = endpoint_spec(
            self.service, transfer=self.transfer, pod_name=pod.name, pod_uid=pod.uid,
            node_name=pod.node_name, serving_port=pod.serving_port,
            kv_events_port=pod.kv_events_port, identity=self.identity)
        published = self.publisher.publish(self.spec)
        metrics.set_info(*self._info())
        return published

    def _info(self) -> tuple[str, str, str, str]:
        engine = self.service.engine
        return self.publisher.pod.namespace, self.transfer, engine.role, engine.engine_id

    def start(self) -> EndpointSync:
        if not self.spec:
            self.publish()
        self._thread = threading.Thread(target=self._loop, name="kvbridge-endpoint-sync",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.spec:
            metrics.clear_info(*self._info())

    def __enter__(self) -> EndpointSync:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:   # apiserver hiccups: log, keep going
                self.errors += 1
                log.warning("KVEndpoint %s: sync failed: %s", self.publisher.name, exc)
            self._stop.wait(self.interval_s)

    def step(self) -> None:
        """One read-handshake-report round (also callable directly in tests)."""
        obj = self.publisher.get()
        epoch = ENDPOINT_FIELDS.epoch
        if obj is None or (obj.get(SPEC) or {}) != self.spec:
            if obj is not None and int(epoch.get(obj.get(SPEC)) or 0) > int(epoch.at(self.spec)):
                log.warning("KVEndpoint %s: a newer epoch %s was published by someone else; "
                            "this agent (epoch %s) is stale", self.publisher.name,
                            epoch.at(obj[SPEC]), epoch.at(self.spec))
                self.service.set_peers([])
                return
            log.info("KVEndpoint %s: (re)publishing spec", self.publisher.name)
            obj = self.publisher.publish(self.spec)
        status = obj.get(STATUS) or {}
        own = ENDPOINT_STATUS_FIELDS
        if int(status.get(own.observed_epoch.key, -1)) != int(epoch.at(self.spec)):
            return   # the operator has not planned this epoch yet
        peers = list(own.peers.get(status) or [])
        now = time.monotonic()
        failed = any(not r.ok for r in self.service.reports())
        if peers == self._last_peers and not (failed and now >= self._retry_at):
            self._report(status)
            return
        self._last_peers = peers
        reports = self.service.set_peers(peers)
        self.rounds += 1
        if any(not r.ok for r in reports):
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self.retry_max_s)
        else:
            self._backoff = 0.5
        self._report(status)
        if self.on_change is not None:
            self.on_change(reports)

    def _report(self, status: Mapping[str, Any]) -> None:
        reports = self.service.reports()
        stored = ENDPOINT_STATUS_FIELDS.handshakes.get(status) or []
        f = HANDSHAKE_FIELDS
        key = [(r.peer, r.epoch, r.ok, r.to_status().get(f.message.key, "")) for r in reports]
        have = [(h.get(f.peer.key), h.get(f.epoch.key),
                 h.get(f.state.key) == HandshakeState.SUCCEEDED, h.get(f.message.key, ""))
                for h in stored]
        if key != have:
            self.publisher.report([r.to_status() for r in reports])
