"""Who this pod is (downward API) and how to reach the apiserver as its ServiceAccount."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import env as names
from ..errors import KVBridgeError

# The variables' names live in kvbridge_agent.env; these aliases keep older imports working.
ENV_POD_NAME, ENV_POD_UID = names.POD_NAME, names.POD_UID
ENV_POD_NAMESPACE, ENV_NODE_NAME, ENV_POD_IP = names.POD_NAMESPACE, names.NODE_NAME, names.POD_IP
ENV_POD_LABELS_FILE, ENV_SERVING_PORT = names.POD_LABELS_FILE, names.SERVING_PORT
DEFAULT_POD_LABELS_FILE = "/etc/podinfo/labels"


class PodLabelsError(KVBridgeError, ValueError):
    """The labels file is not in the downward API's ``key="value"`` format."""


def parse_pod_labels(text: str, source: str = "labels file") -> dict[str, str]:
    """The downward API's rendering of ``metadata.labels``: one ``key="value"`` per line.

    Label keys and values never need escaping (values are at most 63 of ``[A-Za-z0-9._-]``),
    so the quotes are the only syntax.
    """
    labels: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, quoted = line.partition("=")
        if not sep or not key or len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
            raise PodLabelsError(f"{source}, line {number}: expected key=\"value\" (a "
                                 f"downwardAPI item of metadata.labels), got {line!r}")
        labels[key] = quoted[1:-1]
    return labels


def parse_serving_port(text: str, name: str = ENV_SERVING_PORT,
                       what: str = "the engine's OpenAI server port") -> int:  # fmt: skip
    """``$KVBRIDGE_SERVING_PORT`` (or another port variable, ``name``) as a port number; 0
    when it is unset or empty."""
    if not text.strip():
        return 0
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}: expected a TCP port (1-65535, {what}), got {text!r}")
    return port


@dataclass(frozen=True)
class PodIdentity:
    """The pod the agent runs in; the KVEndpoint's ownerReference points at it."""

    name: str
    uid: str
    namespace: str
    node_name: str = ""
    pod_ip: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    #: the engine's OpenAI port; 0: not stated (the router then uses its --engine-port)
    serving_port: int = 0
    #: the port of the engine's KV-event publisher; 0: not stated
    kv_events_port: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodIdentity:
        """From ``POD_NAME``, ``POD_UID``, ``POD_NAMESPACE`` (required), ``NODE_NAME`` and
        ``POD_IP`` (optional), as the example pod template sets them via the downward API.

        The labels, which the KVEndpoint carries so that KVTransfer selectors can match it,
        come from ``$KVBRIDGE_POD_LABELS_FILE`` (default ``/etc/podinfo/labels``, a
        downwardAPI volume item of ``metadata.labels``); none when that file does not exist.
        ``KVBRIDGE_SERVING_PORT`` (optional) is the engine's OpenAI port,
        ``KVBRIDGE_KV_EVENTS_PORT`` (optional) its KV-event publisher's.
        """
        env = os.environ if env is None else env
        missing = [k for k in (ENV_POD_NAME, ENV_POD_UID, ENV_POD_NAMESPACE) if not env.get(k)]
        if missing:
            raise ValueError(
                f"pod identity: environment variables {missing} are not set; expose them with "
                "the downward API (fieldRef metadata.name, metadata.uid, metadata.namespace)")
        labels_file = env.get(ENV_POD_LABELS_FILE) or DEFAULT_POD_LABELS_FILE
        try:
            text = Path(labels_file).read_text()
        except FileNotFoundError:
            labels: dict[str, str] = {}
        else:
            labels = parse_pod_labels(text, labels_file)
        return cls(env[ENV_POD_NAME], env[ENV_POD_UID], env[ENV_POD_NAMESPACE],
                   env.get(ENV_NODE_NAME, ""), env.get(ENV_POD_IP, ""), labels,
                   parse_serving_port(env.get(ENV_SERVING_PORT, "")),
                   parse_serving_port(env.get(names.KV_EVENTS_PORT, ""), names.KV_EVENTS_PORT,
                                      "the engine's KV-event publisher port"))

    def endpoint_name(self, tp_rank: int = 0, tp_size: int = 1) -> str:
        """The KVEndpoint name of one TP rank: the pod's name when the pod runs one rank,
        ``<pod>-tp<rank>`` when it runs several (vLLM's TP workers share one pod, and the
        operator pairs per rank, so each rank publishes its own)."""
        return self.name if tp_size == 1 else f"{self.name}-tp{tp_rank}"

    def owner_reference(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": False}


def api_client(kubeconfig: str | None = None) -> Any:
    """An official-client ``ApiClient``: from ``kubeconfig`` / ``$KUBECONFIG`` when given,
    else the pod's in-cluster ServiceAccount token.

    A request whose answer timed out is not sent again (urllib3 would, three times): the sync
    loop's next round is the retry, and with urllib3's a partitioned agent spent four request
    timeouts (40 s) in one round. Failed connection attempts are still retried.
    """
    from kubernetes import client, config
    from urllib3.util.retry import Retry

    cfg = client.Configuration()
    cfg.retries = Retry(total=3, read=0)
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        config.load_kube_config(config_file=path, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)
