"""vLLM's pull scheduler with the prefill's lease deadline stated and carried to the worker.

vLLM 0.30.0 exports ``remote_blocks_expiry_time`` only for turn-2 read-backs, so a decode
cannot know when a prefill frees its blocks. As a prefill, this scheduler states the
deadline it stamped (and the extension a heartbeat grants); as a decode, it hands that
extension to its worker with the request, which checks the deadline before it reads
(:mod:`._lease`). As a prefill it also marks its params with ``kvbridge_identity`` and
answers kvbridge's identity request on its side channel (:mod:`._listener`); as a decode it
tells its worker which requests come from such a prefill, whose model the worker checks
(:mod:`._peer_models`). Everything else is vLLM's scheduler unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

import vllm
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.utils.network_utils import make_zmq_path

from ..identity import EXCHANGE_VERSION, MARKER_KEY, encode_identity
from ..nixl import heartbeat_extension_s
from ._lease import EXPIRY_KEY, EXTENSION_KEY
from ._listener import serve_side_channel
from ._model import vllm_model_identity

__all__ = ["IDENTITY_PEERS_ATTR", "LEASE_EXTENSIONS_ATTR", "KVBridgePullScheduler"]

#: The attribute of the connector metadata that carries ``{request id: extension_s}`` from
#: the decode's scheduler to its worker (the metadata object is pickled whole to workers).
LEASE_EXTENSIONS_ATTR = "kvbridge_lease_extensions"
#: The attribute carrying the ids of requests whose prefill answers the identity request.
IDENTITY_PEERS_ATTR = "kvbridge_identity_requests"


class KVBridgePullScheduler(NixlPullConnectorScheduler):
    """``NixlPullConnectorScheduler`` that states and forwards lease deadlines and serves
    this engine's model identity."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # The worker computes the same identity with the same setting (both read the files
        # at start-up, before either serves), so what this side states is what it loaded.
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        identity = vllm_model_identity(vllm_config, extra or {}, vllm.__version__)
        self._identity_frame = encode_identity(identity)

    def request_finished(self, request: Any, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and params and params.get("do_remote_prefill"):
            expiry = self._reqs_need_send.get(request.request_id)
            if expiry is not None and params.get(EXPIRY_KEY) is None:
                params[EXPIRY_KEY] = float(expiry)
                params[EXTENSION_KEY] = heartbeat_extension_s(self._kv_lease_duration)
            params[MARKER_KEY] = EXCHANGE_VERSION   # stock decodes ignore the key
        return delay_free, params

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        extensions: dict[str, float] = {}
        marked: set[str] = set()
        for req_id, (request, *_rest) in self._reqs_need_recv.items():
            params = request.kv_transfer_params or {}
            value = params.get(EXTENSION_KEY)
            if isinstance(value, (int, float)) and value > 0:
                extensions[req_id] = float(value)
            marker = params.get(MARKER_KEY)
            if isinstance(marker, int) and marker >= 1:
                marked.add(req_id)
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, LEASE_EXTENSIONS_ATTR, extensions)
        setattr(meta, IDENTITY_PEERS_ATTR, marked)
        return meta

    def _nixl_handshake_listener(  # type: ignore[override]
            self, encoded_data: dict[tuple[int, int], bytes], ready_event: threading.Event,
            stop_event: threading.Event, host: str, port: int) -> None:
        """vLLM's listener (same socket, same replies) that also answers the identity
        request and survives malformed input. vLLM's ``set_xfer_handshake_metadata``
        starts it as ``self._nixl_handshake_listener``, so an instance method is called."""
        with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
            serve_side_channel(sock, encoded_data, self._identity_frame, ready_event,
                               stop_event)
