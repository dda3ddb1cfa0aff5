"""kvbridge_agent.vllm with torch CPU tensors shaped like vLLM's KV cache views, started as
real agents (NIXL, CPU-test mem-type map) and pulled end to end."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
torch = pytest.importorskip("torch")

from kvbridge_agent.nixl import CPU_TEST_MEM_TYPES, NixlUnavailableError, load_nixl  # noqa: E402
from kvbridge_agent.service import AgentSettings, PeerRef  # noqa: E402
from kvbridge_agent.vllm import HOST_POOL_NAME, VllmRegistration, build_views, start_agent  # noqa: E402

NB, BS = 32, 16
HASH = "c" * 64


def mla_caches(fill: bool) -> dict:
    # MLA latent cache: [num_blocks, block_size, kv_lora_rank + rope_dim] bf16
    out = {}
    for i in range(3):
        t = torch.zeros(NB, BS, 576, dtype=torch.bfloat16)
        if fill:
            t.copy_(torch.randn(NB, BS, 576, generator=torch.Generator().manual_seed(i)))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def test_gqa_packed_kv_and_overlaid_groups_views() -> None:
    storage = torch.zeros(NB, 2, BS, 8, 128, dtype=torch.float16)   # K and V packed per block
    caches = {"model.layers.0.self_attn.attn": storage,
              "model.layers.1.self_attn.attn": storage}          # two groups, one storage
    reg = VllmRegistration(kv_caches=caches, engine_id="E", role="decode", compat=HASH,
                           layer_groups={"model.layers.0.self_attn.attn": 0,
                                         "model.layers.1.self_attn.attn": 1})
    views = build_views(reg)
    assert [v.group_id for v in views] == [0, 1]
    assert views[0].block_len == 2 * BS * 8 * 128 * 2 == views[0].block_stride
    assert views[0].addr == views[1].addr
    from kvbridge_agent.geometry import plan_regions

    plan = plan_regions(views)
    assert len(plan.registrations) == 1     # one storage registered once


def test_host_pool_is_a_dram_region_after_the_layers() -> None:
    host = torch.zeros(64 * BS * 576 * 2, dtype=torch.uint8)
    reg = VllmRegistration(kv_caches=mla_caches(False), engine_id="E", role="decode",
                           compat=HASH, is_mla=True, host_pool=host, host_pool_blocks=64)
    views = build_views(reg)
    assert views[-1].name == HOST_POOL_NAME and views[-1].mem_type == "DRAM"
    assert {v.mem_type for v in views[:-1]} == {"VRAM"}
    assert views[-1].num_blocks == 64 and views[-1].block_len == BS * 576 * 2


def test_mla_pull_between_vllm_registrations_is_byte_exact() -> None:
    try:
        load_nixl()
    except NixlUnavailableError:  # pragma: no cover
        pytest.skip("NIXL is not installed")
    settings = AgentSettings(mem_types=CPU_TEST_MEM_TYPES, epoch=1, transfer_timeout_s=5.0)
    pc, dc = mla_caches(True), mla_caches(False)
    common = {"compat": HASH, "is_mla": True, "attn_backend_name": "FLASHMLA",
              "kv_cache_layout": "HND"}
    p = start_agent(VllmRegistration(kv_caches=pc, engine_id="P", role="prefill", **common),
                    settings=settings, publish=False)
    d = start_agent(VllmRegistration(kv_caches=dc, engine_id="D", role="decode", **common),
                    settings=settings, publish=False)
    try:
        assert d.set_peers([PeerRef("p", "P", "127.0.0.1", p.port, 0, 1, 1)])[0].ok
        assert p.set_peers([PeerRef("d", "D", "127.0.0.1", d.port, 0, 1, 1)])[0].ok
        res = d.pull("r", "P", [[3, 4, 5]], [[10, 11, 12]])
        assert res.ok, res
        for name in pc:
            assert torch.equal(dc[name][3:6], pc[name][10:13])
            assert not dc[name][:3].any() and not dc[name][6:].any()
    finally:
        d.close()
        p.close()
