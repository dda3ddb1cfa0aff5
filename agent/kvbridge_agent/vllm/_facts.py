"""What the kvbridge worker needs to know about a vLLM 0.30.0 engine, read once at start-up,
and the settings it refuses (before the engine serves, never at the first request).

The values mirror what vLLM's own NIXL worker derives (kernel block size, physical blocks
per logical block, per-layer page sizes and transfer groups, layout, backend, the
compatibility hash), so a kvbridge engine and a stock engine advertise the same geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    compute_nixl_compatibility_hash,
)
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KpoolTailSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import select_common_block_size

from ._errors import UnsupportedVllmSettingError
from ._events import kv_events_port
from ._model import model_digest

__all__ = [
    "UnsupportedVllmSettingError",
    "VllmEngineFacts",
    "read_engine_facts",
    "refuse_unsupported",
    "static_peer",
]

ROLE_BY_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "decode"}


@dataclass(frozen=True)
class LayerSpec:
    group_id: int
    page_bytes: int          # one kernel block of this layer
    num_blocks: int          # capacity in kernel blocks
    is_mla: bool
    host_resident: bool


@dataclass(frozen=True)
class VllmEngineFacts:
    """The engine facts of one worker (one TP rank)."""

    engine_id: str
    kv_role: str
    tp_rank: int
    tp_size: int
    dp_index: int
    block_size: int          # kernel block size in tokens
    ppl: int                 # physical (kernel) blocks per logical block
    num_blocks: int          # kernel blocks of the main pool
    kv_cache_layout: str
    attn_backend_name: str
    is_mla: bool
    num_kv_heads: int
    compat_hash: str
    hma: bool                # failures are reported per request, not per block
    layers: dict[str, LayerSpec] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the port vLLM's KV-event publisher binds (--kv-events-config); 0: none bound
    kv_events_port: int = 0

    @property
    def role(self) -> str:
        """The KVEndpoint role by ``kv_role`` (``kv_both`` publishes as decode; the worker
        lets ``KVBRIDGE_ROLE`` override it)."""
        return ROLE_BY_KV_ROLE[self.kv_role]


def _layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            specs.update(spec.kv_cache_specs)
        else:
            specs.update(dict.fromkeys(group.layer_names, spec))
    return specs


def refuse_unsupported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise :class:`UnsupportedVllmSettingError` naming the first unsupported setting."""
    par = vllm_config.parallel_config
    ktc = vllm_config.kv_transfer_config

    def refuse(setting: str, value: Any, why: str) -> None:
        raise UnsupportedVllmSettingError(
            f"KVBridgeConnector: {setting}={value!r} is not supported: {why}. Use vLLM's "
            "NixlConnector for this engine, or change the setting.")

    if par.decode_context_parallel_size > 1:
        refuse("decode_context_parallel_size", par.decode_context_parallel_size,
               "kvbridge transfers whole KV blocks, not DCP shards")
    if par.prefill_context_parallel_size > 1:
        refuse("prefill_context_parallel_size", par.prefill_context_parallel_size,
               "kvbridge transfers whole KV blocks, not PCP shards")
    if par.pipeline_parallel_size > 1:
        refuse("pipeline_parallel_size", par.pipeline_parallel_size,
               "pipeline-parallel region slicing is not implemented")
    if ktc.get_from_extra_config("bidirectional_kv_xfer", False):
        refuse("kv_connector_extra_config.bidirectional_kv_xfer", True,
               "turn-2 read-back is not implemented")
    model_digest(dict(ktc.kv_connector_extra_config or {}))   # both roles refuse a bad one
    backends = [b for b in ktc.get_from_extra_config("backends", ["UCX"])]
    if backends != ["UCX"]:
        refuse("kv_connector_extra_config.backends", backends, "kvbridge uses UCX only")
    if current_platform.device_type != "cpu" and ktc.kv_buffer_device == "cpu":
        refuse("kv_buffer_device", "cpu", "host staging buffers on a GPU engine are not "
               "implemented; register the device caches (kv_buffer_device='cuda')")
    for name, spec in _layer_specs(kv_cache_config).items():
        if isinstance(spec, MambaSpec):
            refuse("model (Mamba/SSM layers)", name,
                   "state-space layers are validated but not transferred")
        if isinstance(spec, (CircularBufferSpec, KpoolTailSpec)):
            refuse("model (compressed sparse attention caches)", name,
                   "circular-buffer and k-pool caches are not transferred")
        if int(getattr(spec, "tokens_per_state", 1) or 1) > 1:
            refuse("model (compressed MLA caches)", name,
                   "dense virtual transfer pages are not implemented")


def read_engine_facts(vllm_config: Any, engine_id: str, kv_cache_config: Any
                      ) -> VllmEngineFacts:
    """Derive the engine facts as vLLM's NIXL worker does (see module docstring)."""
    refuse_unsupported(vllm_config, kv_cache_config)
    ktc = vllm_config.kv_transfer_config
    model = vllm_config.model_config
    specs = _layer_specs(kv_cache_config)
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.transfer_groups]
    block_size = math.lcm(*sizes) if sizes else int(vllm_config.cache_config.block_size)
    backends = get_current_attn_backends(vllm_config)
    kernel = int(select_common_block_size(block_size, backends))
    ppl = block_size // kernel if block_size != kernel else 1
    layers: dict[str, LayerSpec] = {}
    by_layer = kv_cache_config.transfer_group_index_by_layer
    for name, spec in specs.items():
        gid = int(by_layer[name])
        group = kv_cache_config.transfer_groups[gid]
        host = bool(getattr(group, "host_resident", False))
        logical = (kv_cache_config.hisparse_host_num_blocks if host
                   else kv_cache_config.num_blocks)
        layers[name] = LayerSpec(
            group_id=gid, page_bytes=int(spec.page_size_bytes) // ppl,
            num_blocks=int(logical) * ppl,
            is_mla=isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)),
            host_resident=host)
    backend_name = backends[0].get_name()
    extra = dict(ktc.kv_connector_extra_config or {})
    return VllmEngineFacts(
        engine_id=str(engine_id), kv_role=str(ktc.kv_role),
        tp_rank=int(get_tensor_model_parallel_rank()),
        tp_size=int(get_tensor_model_parallel_world_size()),
        dp_index=int(vllm_config.parallel_config.data_parallel_index),
        block_size=kernel, ppl=ppl, num_blocks=int(kv_cache_config.num_blocks) * ppl,
        kv_cache_layout=vllm_config.cache_config.get_resolved_kv_cache_layout().name,
        attn_backend_name=backend_name, is_mla=bool(model.use_mla),
        num_kv_heads=1 if model.use_mla else int(model.get_total_num_kv_heads()),
        compat_hash=compute_nixl_compatibility_hash(vllm_config, backend_name, "pull"),
        hma=(not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
             and any(not isinstance(s, FullAttentionSpec) for s in specs.values())),
        layers=layers, extra=extra,
        kv_events_port=kv_events_port(getattr(vllm_config, "kv_events_config", None),
                                      int(vllm_config.parallel_config.data_parallel_index)))


def static_peer(item: Any) -> dict[str, Any]:
    """One ``kvbridge_peers`` entry, checked: ``engine_id``, ``host``, ``port``, ``tp_size``."""
    where = "kv_connector_extra_config.kvbridge_peers"
    if not isinstance(item, dict) or not {"engine_id", "host", "port"} <= set(item):
        raise UnsupportedVllmSettingError(
            f"{where}: expected objects with engine_id, host, port (and tp_size), got {item!r}")
    unknown = set(item) - {"engine_id", "host", "port", "tp_size"}
    if unknown:
        raise UnsupportedVllmSettingError(f"{where}: unknown keys {sorted(unknown)} in {item!r}")
    try:
        return {"engine_id": str(item["engine_id"]), "host": str(item["host"]),
                "port": int(item["port"]), "tp_size": int(item.get("tp_size", 1))}
    except (TypeError, ValueError) as exc:
        raise UnsupportedVllmSettingError(f"{where}: {item!r}: {exc}") from exc
