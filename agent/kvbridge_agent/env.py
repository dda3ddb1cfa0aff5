"""The environment variables the agent reads, each named once.

A pod learns who it is from the downward API (``POD_*``, ``NODE_NAME``), how to bind its side
channel from vLLM's own variables (``VLLM_NIXL_SIDE_CHANNEL_*``) and the rest from
``KVBRIDGE_*``. The chart, the examples and the tests set these names; the agent reads them
through this module only. Pure: names and two small readers.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "AGENT_METRICS_PORT",
    "KV_EVENTS_PORT",
    "NODE_NAME",
    "POD_IP",
    "POD_LABELS_FILE",
    "POD_NAME",
    "POD_NAMESPACE",
    "POD_UID",
    "ROLE",
    "SERVING_PORT",
    "SIDE_CHANNEL_HOST",
    "SIDE_CHANNEL_PORT",
    "SYNC_INTERVAL_S",
    "TRANSFER",
    "in_pod",
    "metrics_port",
]

# -- the downward API ---------------------------------------------------------------------
POD_NAME = "POD_NAME"
POD_UID = "POD_UID"
POD_NAMESPACE = "POD_NAMESPACE"
NODE_NAME = "NODE_NAME"
POD_IP = "POD_IP"
#: Where the pod's labels are read from: a downwardAPI volume item of ``metadata.labels``.
POD_LABELS_FILE = "KVBRIDGE_POD_LABELS_FILE"

# -- vLLM's side channel ------------------------------------------------------------------
SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"

# -- kvbridge -------------------------------------------------------------------------------
#: The KVTransfer this pod's KVEndpoint belongs to.
TRANSFER = "KVBRIDGE_TRANSFER"
#: The engine's role (``prefill`` / ``decode``), where vLLM's kv_role does not say it.
ROLE = "KVBRIDGE_ROLE"
#: The port the engine's OpenAI server listens on (vLLM's ``--port``), published as
#: ``spec.servingPort`` so that the P/D router can reach engines that share one address.
SERVING_PORT = "KVBRIDGE_SERVING_PORT"
#: ``spec.kvEventsPort``: the port of the engine's KV-event publisher, for routers that choose
#: pairs by prefix cache (the vLLM connector reads it from --kv-events-config itself).
KV_EVENTS_PORT = "KVBRIDGE_KV_EVENTS_PORT"
#: Port of the agent's Prometheus ``/metrics`` (unset: not served; 0: a free port).
AGENT_METRICS_PORT = "KVBRIDGE_AGENT_METRICS_PORT"
#: Seconds between two reads of the pod's KVEndpoint.
SYNC_INTERVAL_S = "KVBRIDGE_SYNC_INTERVAL_S"


def in_pod(env: Mapping[str, str]) -> bool:
    """Whether the downward API names this pod (then the agent publishes a KVEndpoint)."""
    return bool(env.get(POD_NAME) and env.get(POD_UID))


def metrics_port(env: Mapping[str, str]) -> int | None:
    """The agent's metrics port, or None when none is to be served."""
    raw = env.get(AGENT_METRICS_PORT)
    return int(raw) if raw else None
