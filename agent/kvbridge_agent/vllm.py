"""vLLM integration: from what vLLM's KV connector gets at ``register_kv_caches`` to a running
agent (and its KVEndpoint) in a few lines::

    from kvbridge_agent.vllm import VllmRegistration, start_agent

    reg = VllmRegistration(kv_caches=kv_caches, layer_groups=groups, block_size=16,
                           engine_id=engine_id, role="decode", tp_rank=rank, tp_size=tp,
                           compat=factors, host_pool=host_tensor, host_pool_blocks=4096)
    agent = start_agent(reg, transfer="llama-70b")   # publishes + follows its KVEndpoint

Duck-typed: tensors need ``data_ptr()``, ``shape``, ``stride()``, ``element_size()`` and
``device``; torch is never imported here. Layouts handled (blocks-first views, as vLLM hands
them over): MLA latent caches ``[num_blocks, block_size, head_dim]``; GQA caches with K and
V packed per block ``[num_blocks, 2, block_size, heads, head_dim]``; several layers (or
groups) that are views of one storage (the registration is deduplicated by storage); a DRAM
host-resident pool beside the device caches (``host_pool``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .geometry import CacheView
from .protocol import CompatibilityFactors
from .service import AgentService, AgentSettings, EngineInfo

__all__ = ["HOST_POOL_NAME", "VllmRegistration", "build_views", "start_agent"]

#: Region name of the host-resident pool (sorts after every ``model.layers.*`` name).
HOST_POOL_NAME = "zz.host_pool"


@dataclass
class VllmRegistration:
    """What vLLM's connector knows at registration.

    Attributes:
        kv_caches: layer name -> KV cache tensor (blocks-first view).
        layer_groups: layer name -> transfer-group index (default: every layer group 0).
        block_size / kernel_block_size: logical and kernel block size in tokens; ppl =
            block_size // kernel_block_size.
        num_blocks: kernel blocks of the main pool (default: the tensors' first dim).
        host_pool / host_pool_blocks / host_pool_group: optional DRAM pool (CPU tensor).
        kv_cache_layout / attn_backend_name / is_mla / num_kv_heads: engine facts.
        mem_type: of the device caches (``"VRAM"``; tests on CPU pass the CPU-test map).
    """

    kv_caches: Mapping[str, Any]
    engine_id: str
    role: str
    compat: CompatibilityFactors | Mapping[str, Any] | str
    layer_groups: Mapping[str, int] = field(default_factory=dict)
    block_size: int = 16
    kernel_block_size: int | None = None
    num_blocks: int | None = None
    host_pool: Any = None
    host_pool_blocks: int = 0
    host_pool_group: int = 0
    kv_cache_layout: str = "HND"
    attn_backend_name: str = "FLASH_ATTN"
    is_mla: bool = False
    num_kv_heads: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    dp_index: int = 0
    mode: str = "pull"
    mem_type: str = "VRAM"

    @property
    def ppl(self) -> int:
        k = self.kernel_block_size or self.block_size
        if self.block_size % k:
            raise ValueError(f"block_size {self.block_size} is not a multiple of "
                             f"kernel_block_size {k}")
        return self.block_size // k


def build_views(reg: VllmRegistration) -> list[CacheView]:
    """One ``CacheView`` per layer (plus the host pool), in vLLM's terms."""
    views = []
    for name, t in reg.kv_caches.items():
        views.append(CacheView.from_tensor(
            name, t, group_id=int(reg.layer_groups.get(name, 0)), is_mla=reg.is_mla,
            mem_type=reg.mem_type))
    if reg.host_pool is not None:
        if reg.host_pool_blocks <= 0:
            raise ValueError("host_pool_blocks: expected > 0 with a host_pool")
        views.append(CacheView.from_tensor(
            HOST_POOL_NAME, reg.host_pool, group_id=reg.host_pool_group,
            num_blocks=reg.host_pool_blocks if len(reg.host_pool.shape) == 1 else None,
            is_mla=reg.is_mla, mem_type="DRAM"))
    return views


def engine_info(reg: VllmRegistration) -> EngineInfo:
    return EngineInfo(
        reg.engine_id, reg.role, tp_rank=reg.tp_rank, tp_size=reg.tp_size,
        dp_index=reg.dp_index, block_size=reg.kernel_block_size or reg.block_size,
        ppl=reg.ppl, num_blocks=reg.num_blocks, kv_cache_layout=reg.kv_cache_layout,
        attn_backend_name=reg.attn_backend_name, is_mla=reg.is_mla,
        num_kv_heads=reg.num_kv_heads, mode=reg.mode)


def start_agent(reg: VllmRegistration, *, transfer: str | None = None,
                settings: AgentSettings | None = None, publish: bool | None = None,
                sync_interval_s: float = 1.0) -> AgentService:
    """Register the caches, start the side channel and (in a pod) publish the KVEndpoint.

    The side channel binds ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` (default ``0.0.0.0``) on
    ``$VLLM_NIXL_SIDE_CHANNEL_PORT`` (+ dp index) and advertises ``$POD_IP``. ``publish``
    defaults to "the downward API variables are set"; ``transfer`` defaults to
    ``$KVBRIDGE_TRANSFER``. The returned service carries ``.sync`` (or ``None``).
    """
    env = os.environ
    if settings is None:
        settings = AgentSettings(
            side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0"),
            side_channel_port=int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
            advertise_host=env.get("POD_IP") or None)
    service = AgentService(build_views(reg), engine_info(reg), reg.compat, settings).start()
    service.sync = None  # type: ignore[attr-defined]
    if publish is None:
        publish = bool(env.get("POD_NAME") and env.get("POD_UID"))
    if publish:
        from .kube import EndpointPublisher, EndpointSync, PodIdentity, api_client

        pod = PodIdentity.from_env()
        sync = EndpointSync(service, EndpointPublisher(api_client(), pod),
                            transfer or env["KVBRIDGE_TRANSFER"], interval_s=sync_interval_s)
        try:
            sync.start()
        except BaseException:
            service.close()
            raise
        service.sync = sync  # type: ignore[attr-defined]
    return service
