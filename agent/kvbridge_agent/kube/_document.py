"""The KVEndpoint ``spec`` document an agent publishes for its registration (flow 2),
laid out by the field table in :mod:`kvbridge_agent.resources`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..protocol import NIXL_CONNECTOR_VERSION
from ..resources import endpoint_document

if TYPE_CHECKING:
    from ..identity import ModelIdentity
    from ..service import AgentService

__all__ = ["endpoint_spec"]


def endpoint_spec(service: AgentService, *, transfer: str, pod_name: str, pod_uid: str = "",
                  node_name: str = "", serving_port: int = 0, kv_events_port: int = 0,
                  identity: ModelIdentity | None = None) -> dict[str, Any]:
    """The KVEndpoint ``spec`` for ``service``'s registration (a started agent), with the
    model it serves (``spec.model``, ``spec.versions``) when ``identity`` is given."""
    assert service.metadata is not None, "start() first"
    e, m = service.engine, service.metadata
    regions = [
        {"name": name, "num_blocks": int(nb), "group_id": int(g), "mem_type": mt,
         "block_len": int(bl), "block_stride": int(bs)}
        for name, nb, g, mt, bl, bs in zip(
            m.region_names or (), m.region_num_blocks or (), m.region_group_ids or (),
            m.region_mem_types or (), m.block_lens, m.block_strides, strict=True)
    ]
    geometry = {
        "block_size": e.block_size, "physical_blocks_per_logical": e.ppl,
        "num_blocks": int(m.num_blocks), "kv_cache_layout": e.kv_cache_layout,
        "attention_backend": e.attn_backend_name, "is_mla": e.is_mla,
        "num_kv_heads": e.num_kv_heads, "dcp_size": e.dcp_size, "pcp_size": e.pcp_size,
    }
    spec = {
        "role": e.role, "transfer": transfer, "engine_id": e.engine_id, "pod_name": pod_name,
        "pod_uid": pod_uid, "node_name": node_name, "host": service.advertise_host,
        "port": service.port, "tp_rank": e.tp_rank, "tp_size": e.tp_size,
        "dp_index": e.dp_index, "protocol_version": NIXL_CONNECTOR_VERSION,
        "compatibility_hash": service.hash, "mode": e.mode, "epoch": service.epoch,
        "serving_port": serving_port, "kv_events_port": kv_events_port,
    }
    if identity is not None:
        spec.update(identity.fields())
    return endpoint_document(spec, geometry, regions)
