"""The KVEndpoint ``spec`` document an agent publishes for its registration (flow 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..protocol import NIXL_CONNECTOR_VERSION

if TYPE_CHECKING:
    from ..service import AgentService

__all__ = ["endpoint_spec"]


def endpoint_spec(service: AgentService, *, transfer: str, pod_name: str, pod_uid: str = "",
                  node_name: str = "", serving_port: int = 0) -> dict[str, Any]:
    """The KVEndpoint ``spec`` for ``service``'s registration (a started agent)."""
    assert service.metadata is not None, "start() first"
    e, m = service.engine, service.metadata
    regions = [
        {"name": name, "numBlocks": int(nb), "groupId": int(g), "memType": mt,
         "blockLen": int(bl), "blockStride": int(bs)}
        for name, nb, g, mt, bl, bs in zip(
            m.region_names or (), m.region_num_blocks or (), m.region_group_ids or (),
            m.region_mem_types or (), m.block_lens, m.block_strides, strict=True)
    ]
    geometry: dict[str, Any] = {
        "blockSize": e.block_size, "physicalBlocksPerLogical": e.ppl,
        "numBlocks": int(m.num_blocks), "kvCacheLayout": e.kv_cache_layout,
        "attentionBackend": e.attn_backend_name, "isMla": e.is_mla,
        "dcpSize": e.dcp_size, "pcpSize": e.pcp_size, "regions": regions,
    }
    if e.num_kv_heads is not None:
        geometry["numKvHeads"] = e.num_kv_heads
    spec: dict[str, Any] = {
        "transferName": transfer, "role": e.role, "engineId": e.engine_id,
        "podName": pod_name, "sideChannel": {"host": service.advertise_host,
                                             "port": service.port},
        "tpRank": e.tp_rank, "tpSize": e.tp_size, "dpIndex": e.dp_index,
        "protocolVersion": NIXL_CONNECTOR_VERSION, "compatibilityHash": service.hash,
        "mode": e.mode, "epoch": service.epoch, "geometry": geometry,
    }
    if pod_uid:
        spec["podUID"] = pod_uid
    if node_name:
        spec["nodeName"] = node_name
    if serving_port:
        spec["servingPort"] = serving_port
    return spec
