"""vLLM integration: from what vLLM's KV connector gets at ``register_kv_caches`` to a running
agent (and its KVEndpoint) in a few lines::

    from kvbridge_agent.vllm import VllmRegistration, start_agent

    reg = VllmRegistration(kv_caches=kv_caches, layer_groups=groups, block_size=16,
                           engine_id=engine_id, role="decode", tp_rank=rank, tp_size=tp,
                           compat=factors, host_resident_groups={1},
                           host_num_blocks=4096)
    agent = start_agent(reg, transfer="llama-70b")   # publishes + follows its KVEndpoint

Duck-typed: tensors need ``data_ptr()``, ``shape``, ``stride()``, ``element_size()`` and
``device``; torch is never imported here. Layouts handled (blocks-first views, as vLLM hands
them over): MLA latent caches ``[num_blocks, block_size, head_dim]``; GQA caches with K and
V packed per block ``[num_blocks, 2, block_size, heads, head_dim]``; several layers (or
groups) that are views of one storage (the registration is deduplicated by storage); and a
host-resident (HiSparse-style) group whose layers' caches live in DRAM with their own
capacity, beside the device caches (spec §2.3 step 3, §9.1). The host-resident layers keep
their real layer names, so ``region_names`` still match the prefill side and the pull takes
the region-mapped path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import env as names
from ..geometry import CacheView
from ..protocol import CompatibilityFactors
from ..service import AgentService, AgentSettings, EngineInfo

if TYPE_CHECKING:
    from ..identity import ModelIdentity
    from ..kube import EndpointSync, PodDuties

__all__ = ["StartedAgent", "VllmRegistration", "build_views", "start_agent"]


@dataclass
class VllmRegistration:
    """What vLLM's connector knows at registration.

    Attributes:
        kv_caches: layer name -> KV cache tensor (blocks-first view).
        layer_groups: layer name -> transfer-group index (default: every layer group 0).
        block_size / kernel_block_size: logical and kernel block size in tokens; ppl =
            block_size // kernel_block_size, and each tensor row is one logical block.
        num_blocks: kernel blocks of the main pool (default: the largest region capacity).
        host_resident_groups / host_num_blocks: transfer groups whose caches are in host
            memory (DRAM, registered by the view's own range) and their capacity in
            logical blocks (``hisparse_host_num_blocks``).
        kv_cache_layout / attn_backend_name / is_mla / num_kv_heads: engine facts.
        device_mem_type: memory type of the device caches; ``None`` infers it from each
            tensor's device (CPU -> DRAM, otherwise VRAM). CPU-only tests pass ``"VRAM"``
            together with the CPU-test memory-type map.
    """

    kv_caches: Mapping[str, Any]
    engine_id: str
    role: str
    compat: CompatibilityFactors | Mapping[str, Any] | str
    layer_groups: Mapping[str, int] = field(default_factory=dict)
    block_size: int = 16
    kernel_block_size: int | None = None
    num_blocks: int | None = None
    host_resident_groups: Set[int] = frozenset()
    host_num_blocks: int | None = None
    kv_cache_layout: str = "HND"
    attn_backend_name: str = "FLASH_ATTN"
    is_mla: bool = False
    num_kv_heads: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    dp_index: int = 0
    mode: str = "pull"
    device_mem_type: str | None = None

    @property
    def ppl(self) -> int:
        k = self.kernel_block_size or self.block_size
        if k < 1 or self.block_size % k:
            raise ValueError(f"block_size {self.block_size} is not a multiple of "
                             f"kernel_block_size {k}")
        return self.block_size // k


def build_views(reg: VllmRegistration) -> list[CacheView]:
    """One ``CacheView`` per layer, in vLLM's terms (spec §2.3)."""
    if reg.host_resident_groups and (reg.host_num_blocks is None or reg.host_num_blocks < 1):
        raise ValueError("host_num_blocks: expected a block count >= 1 with "
                         f"host_resident_groups {sorted(reg.host_resident_groups)}")
    ppl = reg.ppl
    views = []
    for name, tensor in reg.kv_caches.items():
        group = int(reg.layer_groups.get(name, 0))
        if group in reg.host_resident_groups:
            view = CacheView.from_tensor(
                name, tensor, group_id=group, is_mla=reg.is_mla, mem_type="DRAM", ppl=ppl,
                num_blocks=int(reg.host_num_blocks) * ppl)
            # Host pools are registered by the view's own blocks, not the whole storage.
            view = replace(view, reg_base=None, reg_nbytes=None)
        else:
            view = CacheView.from_tensor(name, tensor, group_id=group, is_mla=reg.is_mla,
                                         mem_type=reg.device_mem_type, ppl=ppl)
        views.append(view)
    return views


def engine_info(reg: VllmRegistration, views: list[CacheView]) -> EngineInfo:
    """Engine facts; ``num_blocks`` defaults to the main (device) pool's kernel blocks."""
    num_blocks = reg.num_blocks
    if num_blocks is None:
        main = [v.num_blocks for v in views if v.group_id not in reg.host_resident_groups]
        num_blocks = max(main, default=None)
    return EngineInfo(
        reg.engine_id, reg.role, tp_rank=reg.tp_rank, tp_size=reg.tp_size,
        dp_index=reg.dp_index, block_size=reg.kernel_block_size or reg.block_size,
        ppl=reg.ppl, num_blocks=num_blocks, kv_cache_layout=reg.kv_cache_layout,
        attn_backend_name=reg.attn_backend_name, is_mla=reg.is_mla,
        num_kv_heads=reg.num_kv_heads, mode=reg.mode)


@dataclass
class StartedAgent:
    """What :func:`start_agent` started: the agent and the pod's duties beside it
    (:class:`~kvbridge_agent.kube.PodDuties`). It answers for the agent (``pull``,
    ``set_peers``, ``port``, ...: the service's own attributes), so callers use it as one;
    :meth:`close` ends both."""

    service: AgentService
    duties: PodDuties

    @property
    def metrics_port(self) -> int | None:
        return self.duties.metrics_port

    @property
    def sync(self) -> EndpointSync | None:
        return self.duties.sync

    def __getattr__(self, name: str) -> Any:   # only names this class lacks
        return getattr(self.service, name)

    def close(self) -> None:
        self.duties.stop()
        self.service.close()

    def __enter__(self) -> StartedAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_agent(reg: VllmRegistration, *, transfer: str | None = None,
                settings: AgentSettings | None = None, publish: bool | None = None,
                sync_interval_s: float = 1.0, metrics_port: int | None = None,
                identity: ModelIdentity | None = None) -> StartedAgent:
    """Register the caches, start the side channel and (in a pod) publish the KVEndpoint.

    The side channel binds ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` (default ``0.0.0.0``) on
    ``$VLLM_NIXL_SIDE_CHANNEL_PORT`` (+ dp index) and advertises ``$POD_IP``. ``publish``
    defaults to "the downward API variables are set"; ``transfer`` defaults to
    ``$KVBRIDGE_TRANSFER``. Prometheus metrics are served on ``metrics_port`` (default
    ``$KVBRIDGE_AGENT_METRICS_PORT``; 0 picks a free port; unset serves none).
    ``identity`` (:func:`kvbridge_agent.identity.identify_model`) is the model the engine
    serves; the KVEndpoint states it, and the operator pairs only endpoints with equal
    fingerprints. Without one the endpoint has none, and pairs only with others that have
    none.
    """
    from ..kube import EndpointPublisher, PodDuties, PodIdentity, api_client

    env = os.environ
    if metrics_port is None:
        metrics_port = names.metrics_port(env)
    if settings is None:
        settings = AgentSettings(
            side_channel_host=env.get(names.SIDE_CHANNEL_HOST, "0.0.0.0"),
            side_channel_port=int(env.get(names.SIDE_CHANNEL_PORT, "5600")),
            advertise_host=env.get(names.POD_IP) or None)
    views = build_views(reg)
    service = AgentService(views, engine_info(reg, views), reg.compat, settings).start()
    if publish is None:
        publish = names.in_pod(env)
    try:
        pod = PodIdentity.from_env() if publish else None
        publisher = EndpointPublisher(api_client(), pod) if pod is not None else None
        duties = PodDuties.start(service, metrics_port=metrics_port, publisher=publisher,
                                 transfer=(transfer or env[names.TRANSFER]) if publish else "",
                                 sync_interval_s=sync_interval_s, identity=identity)
    except BaseException:
        service.close()
        raise
    return StartedAgent(service, duties)
