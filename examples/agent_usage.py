"""Using the kvbridge agent from a vLLM KV connector (a sketch of the few lines it takes).

At ``register_kv_caches(kv_caches)`` time the connector knows the layer -> tensor dict, each
layer's transfer group, block sizes, engine facts and the compatibility factors:
"""

from __future__ import annotations

from typing import Any

from kvbridge_agent.protocol import CompatibilityFactors
from kvbridge_agent.vllm import VllmRegistration, start_agent


def register(kv_caches: dict[str, Any], groups: dict[str, int], engine_id: str, role: str,
             tp_rank: int, tp_size: int) -> Any:
    factors = CompatibilityFactors(
        vllm_version="0.11.0", model="meta-llama/Llama-3.1-70B-Instruct",
        dtype="torch.bfloat16", num_kv_heads=8, head_size=128, num_hidden_layers=80,
        attn_backend_name="FLASH_ATTN")
    reg = VllmRegistration(kv_caches=kv_caches, layer_groups=groups, engine_id=engine_id,
                           role=role, compat=factors, block_size=16, tp_rank=tp_rank,
                           tp_size=tp_size, kv_cache_layout="HND",
                           attn_backend_name="FLASH_ATTN", num_kv_heads=8)
    # Registers with NIXL, serves the v11 side channel, publishes the KVEndpoint (in a pod)
    # and preflights the peers the operator assigns.
    return start_agent(reg)


def on_request(agent: Any, req: Any) -> bool:
    # Decode side: the peer was handshaken in advance; the request never waits for it.
    res = agent.pull(req.request_id, req.remote_engine_id, req.local_block_ids,
                     req.remote_block_ids, remote_request_id=req.remote_request_id)
    return res.ok   # res.cause names a failure ("timeout", "remote_disconnect", ...)
