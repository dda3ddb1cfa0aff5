"""vLLM's pull scheduler with the prefill's lease deadline stated and carried to the worker.

vLLM 0.30.0 exports ``remote_blocks_expiry_time`` only for turn-2 read-backs, so a decode
cannot know when a prefill frees its blocks. As a prefill, this scheduler states the
deadline it stamped (and the extension a heartbeat grants); as a decode, it hands that
extension to its worker with the request, which checks the deadline before it reads
(:mod:`._lease`). Everything else is vLLM's scheduler unchanged.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

from ..nixl import heartbeat_extension_s
from ._lease import EXPIRY_KEY, EXTENSION_KEY

__all__ = ["LEASE_EXTENSIONS_ATTR", "KVBridgePullScheduler"]

#: The attribute of the connector metadata that carries ``{request id: extension_s}`` from
#: the decode's scheduler to its worker (the metadata object is pickled whole to workers).
LEASE_EXTENSIONS_ATTR = "kvbridge_lease_extensions"


class KVBridgePullScheduler(NixlPullConnectorScheduler):
    """``NixlPullConnectorScheduler`` that states and forwards lease deadlines."""

    def request_finished(self, request: Any, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and params and params.get("do_remote_prefill"):
            expiry = self._reqs_need_send.get(request.request_id)
            if expiry is not None and params.get(EXPIRY_KEY) is None:
                params[EXPIRY_KEY] = float(expiry)
                params[EXTENSION_KEY] = heartbeat_extension_s(self._kv_lease_duration)
        return delay_free, params

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        extensions: dict[str, float] = {}
        for req_id, (request, *_rest) in self._reqs_need_recv.items():
            value = (request.kv_transfer_params or {}).get(EXTENSION_KEY)
            if isinstance(value, (int, float)) and value > 0:
                extensions[req_id] = float(value)
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, LEASE_EXTENSIONS_ATTR, extensions)
        return meta
