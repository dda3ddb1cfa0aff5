"""Create or update this rank's KVEndpoint and write its ``status.handshakes``.

Needs only what the chart's agent Role grants: ``get``/``create``/``update``/``patch`` on
``kvendpoints`` and ``patch`` on ``kvendpoints/status``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import KVBridgeError
from ..resources import (
    API_VERSION,
    ENDPOINT_FIELDS,
    ENDPOINT_KIND,
    ENDPOINT_STATUS_FIELDS,
    ENDPOINTS,
    GROUP,
    SPEC,
    STATUS,
    VERSION,
)
from ._identity import PodIdentity

PLURAL = ENDPOINTS
log = logging.getLogger("kvbridge.agent.kube")


class PublishError(KVBridgeError, RuntimeError):
    """The KVEndpoint could not be written (the message carries the apiserver's reason)."""


def _reason(exc: Any) -> str:
    import json

    try:
        body = json.loads(exc.body)
        return f"HTTP {exc.status}: {body.get('message', exc.reason)}"
    except Exception:
        return f"HTTP {getattr(exc, 'status', '?')}: {getattr(exc, 'reason', exc)}"


class EndpointPublisher:
    """Writes one KVEndpoint named ``name`` (default: the pod's name) in the pod's namespace.

    Args:
        api_client: an official-client ``ApiClient`` authenticated as the workload
            ServiceAccount (see :func:`~.api_client`).
        pod: the owning pod.
        name: the KVEndpoint name.
        labels: labels to put on the endpoint (the KVTransfer selectors match them).
    """

    def __init__(self, api_client: Any, pod: PodIdentity, *, name: str | None = None,
                 labels: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.pod = pod
        self.name = name or pod.name
        self.labels = dict(labels or pod.labels)
        self.timeout_s = timeout_s

    def get(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.pod.namespace, PLURAL, self.name,
                _request_timeout=self.timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise PublishError(f"reading KVEndpoint {self.pod.namespace}/{self.name}: "
                               f"{_reason(exc)}") from exc

    def next_epoch(self, proposed: int) -> int:
        """An epoch above the stored one (epochs only grow, admission enforces it)."""
        current = self.get()
        old = int(ENDPOINT_FIELDS.epoch.get((current or {}).get(SPEC)) or 0)
        return max(int(proposed), old + 1)

    def publish(self, spec: Mapping[str, Any], *, attempts: int = 5) -> dict[str, Any]:
        """Create the KVEndpoint, or replace its spec (and labels/owner) when it exists.
        Returns the stored object. Conflicts are retried ``attempts`` times."""
        from kubernetes.client.exceptions import ApiException

        ns = self.pod.namespace
        body = {
            "apiVersion": API_VERSION, "kind": ENDPOINT_KIND,
            "metadata": {"name": self.name, "namespace": ns, "labels": self.labels,
                         "ownerReferences": [self.pod.owner_reference()]},
            SPEC: dict(spec),
        }
        last: Exception | None = None
        for _ in range(max(1, attempts)):
            current = self.get()
            try:
                if current is None:
                    return self.api.create_namespaced_custom_object(
                        GROUP, VERSION, ns, PLURAL, body, _request_timeout=self.timeout_s)
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                return self.api.replace_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, self.name, body,
                    _request_timeout=self.timeout_s)
            except ApiException as exc:
                last = exc
                if exc.status in (409, 429, 500, 503):
                    time.sleep(0.2)
                    continue
                raise PublishError(
                    f"publishing KVEndpoint {ns}/{self.name}: {_reason(exc)}") from exc
        raise PublishError(f"publishing KVEndpoint {ns}/{self.name}: gave up after "
                           f"{attempts} attempts: {last}")

    def report(self, handshakes: Iterable[Mapping[str, Any]]) -> None:
        """Write ``status.handshakes`` (the agent's own status field; merge patch replaces
        the list and leaves the operator's keys alone)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.pod.namespace, PLURAL, self.name,
                {STATUS: {ENDPOINT_STATUS_FIELDS.handshakes.key: list(handshakes)}},
                _request_timeout=self.timeout_s)
        except ApiException as exc:
            raise PublishError(f"reporting handshakes of KVEndpoint {self.pod.namespace}/"
                               f"{self.name}: {_reason(exc)}") from exc
