"""kvbridge inside vLLM.

Two ways in:

- **vLLM 0.30.0 engines** load :class:`KVBridgeConnector` with one flag::

      vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge_agent.vllm", "kv_role": "kv_both"}'

  The scheduler side is vLLM's own NIXL connector (request flow, ``kv_transfer_params``,
  block leases, the v11 side channel), so kvbridge and stock vLLM pods interoperate in both
  directions; the worker side is kvbridge's agent (:mod:`._worker`). In a pod with the
  downward-API variables it also publishes the KVEndpoint and preflights the operator's
  peers. Importing this package does not import vLLM: the connector module loads on first
  access to ``KVBridgeConnector``.

- **Other engines** call :func:`start_agent` with a :class:`VllmRegistration` (the caches
  and engine facts), see :mod:`._registration`.
"""

from __future__ import annotations

from typing import Any

from ._registration import (
    StartedAgent,
    VllmRegistration,
    build_views,
    engine_info,
    start_agent,
)

__all__ = ["KVBridgeConnector", "StartedAgent", "VllmRegistration", "build_views",
           "engine_info", "start_agent"]


def __getattr__(name: str) -> Any:
    # vLLM's connector factory does getattr(import_module(path), class_name): resolve the
    # connector lazily so that kvbridge_agent.vllm imports where vLLM is not installed.
    if name in ("KVBridgeConnector", "KVBridgePushConnector"):
        from . import _connector

        return getattr(_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
