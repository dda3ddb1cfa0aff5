"""Where an engine's KV events can be read: the port of vLLM's ZMQ publisher, which kvbridge's
connector publishes as the KVEndpoint's ``spec.kvEventsPort`` for cache-aware routers. Pure:
no vLLM import.
"""

from __future__ import annotations

from typing import Any


def kv_events_port(config: Any, dp_index: int = 0) -> int:
    """The TCP port vLLM's ZMQ KV-event publisher binds, which a router can subscribe to;
    0 when events are off, not published over ZMQ, or sent out (an endpoint with a host
    makes vLLM connect, not bind). vLLM offsets the port by the data-parallel rank."""
    if config is None or not getattr(config, "enable_kv_cache_events", False):
        return 0
    endpoint = str(getattr(config, "endpoint", "") or "")
    if getattr(config, "publisher", "") != "zmq" or not endpoint.startswith("tcp://"):
        return 0
    if "*" not in endpoint and "::" not in endpoint:
        return 0
    try:
        return int(endpoint.rsplit(":", 1)[1]) + dp_index
    except ValueError:
        return 0
