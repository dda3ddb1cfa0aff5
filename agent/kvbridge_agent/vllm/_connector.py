"""``KVBridgeConnector``: vLLM's NIXL connector with kvbridge's agent as its worker.

Loaded by vLLM's connector factory through ``kv_connector_module_path``. The scheduler side
is vLLM's ``NixlPullConnectorScheduler`` (request flow, ``kv_transfer_params``, leases, the
v11 side channel serving the payload this worker builds), so kvbridge and stock vLLM
engines interoperate both ways; it adds only the lease deadline a prefill states and a
decode checks (:mod:`._scheduler`, :mod:`._lease`). Unsupported settings fail here, at
engine start-up, with the setting named; so does a vLLM release the connector was not
tested with (:mod:`._version_gate`, opt-in ``kvbridge_allow_untested_vllm``). Push mode
(vLLM's ``NixlPushConnector``) is not offered: ``KVBridgePushConnector`` exists only to say
so.
"""

from __future__ import annotations

from typing import Any

from vllm import __version__ as VLLM_VERSION
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from ._facts import UnsupportedVllmSettingError, refuse_unsupported
from ._scheduler import KVBridgePullScheduler
from ._version_gate import check_vllm_version
from ._worker import KVBridgeWorker

__all__ = ["KVBridgeConnector", "KVBridgePushConnector"]


class KVBridgeConnector(NixlPullConnector):
    """Pull-mode (READ) P/D connector: vLLM's scheduler side, kvbridge's worker side."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # First: in an untested vLLM release anything below may misread the engine.
        _check_vllm_release(vllm_config)
        # Skip NixlPullConnector.__init__: it would build vLLM's own worker (and NIXL agent).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        refuse_unsupported(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVBridgePullScheduler(
                vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVBridgeWorker(  # type: ignore[assignment]
                vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"KVBridgeConnector: unsupported connector role {role!r}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert isinstance(self.connector_worker, KVBridgeWorker)
        assert isinstance(self._connector_metadata, NixlConnectorMetadata)
        self.connector_worker.start_load_kv(self._connector_metadata)


def _check_vllm_release(vllm_config: Any) -> None:
    """Refuse an untested vLLM release unless ``kvbridge_allow_untested_vllm`` opts in."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    check_vllm_version(VLLM_VERSION, getattr(transfer, "kv_connector_extra_config", None))


class KVBridgePushConnector(KVBridgeConnector):
    """Refuses at start-up: kvbridge's connector does not implement vLLM's push mode."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        raise UnsupportedVllmSettingError(
            "KVBridgePushConnector: push mode (prefill WRITEs, vLLM's NixlPushConnector) is "
            "not implemented by kvbridge's vLLM connector; use KVBridgeConnector (pull) or "
            "vLLM's NixlPushConnector")
