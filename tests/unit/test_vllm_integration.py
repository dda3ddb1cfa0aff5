"""kvbridge_agent.vllm with torch CPU tensors shaped like vLLM's KV cache views, started as
real agents (NIXL, CPU-test mem-type map) and pulled end to end."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
torch = pytest.importorskip("torch")

from kvbridge_agent.nixl import CPU_TEST_MEM_TYPES, NixlUnavailableError, load_nixl  # noqa: E402
from kvbridge_agent.service import AgentSettings, PeerRef  # noqa: E402
from kvbridge_agent.vllm import VllmRegistration, build_views, start_agent  # noqa: E402

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


HOST_LAYER = "model.layers.2.self_attn.attn"


def test_host_resident_group_is_dram_with_its_own_capacity() -> None:
    caches = mla_caches(False)
    caches[HOST_LAYER] = torch.zeros(48, BS, 576, dtype=torch.bfloat16)  # host pool, CPU
    reg = VllmRegistration(kv_caches=caches, engine_id="E", role="decode", compat=HASH,
                           is_mla=True, device_mem_type="VRAM",
                           layer_groups={HOST_LAYER: 1}, host_resident_groups={1},
                           host_num_blocks=48)
    views = {v.name: v for v in build_views(reg)}
    host = views[HOST_LAYER]
    assert (host.mem_type, host.group_id, host.num_blocks) == ("DRAM", 1, 48)
    assert host.registration == (caches[HOST_LAYER].data_ptr(), 48 * BS * 576 * 2)
    assert {views[n].mem_type for n in views if n != HOST_LAYER} == {"VRAM"}
    # layer names are unchanged, so region_names still match a prefill engine's
    assert sorted(views) == sorted(mla_caches(False))


def test_ppl_splits_logical_rows_into_kernel_blocks() -> None:
    caches = {"model.layers.0.self_attn.attn": torch.zeros(NB, 64, 576, dtype=torch.bfloat16)}
    reg = VllmRegistration(kv_caches=caches, engine_id="E", role="decode", compat=HASH,
                           is_mla=True, block_size=64, kernel_block_size=16)
    (view,) = build_views(reg)
    assert reg.ppl == 4
    assert (view.num_blocks, view.block_len, view.block_stride) == (NB * 4,) + (16 * 576 * 2,) * 2


def test_host_pool_without_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="host_num_blocks"):
        build_views(VllmRegistration(kv_caches=mla_caches(False), engine_id="E",
                                     role="decode", compat=HASH, host_resident_groups={1}))


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


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
                    settings=settings, publish=False, metrics_port=0)
    try:
        before = _scrape(d.metrics_port)
        assert d.set_peers([PeerRef("p", "P", "127.0.0.1", p.port, 0, 1, 1)])[0].ok
        assert p.set_peers([PeerRef("d", "D", "127.0.0.1", d.port, 0, 1, 1)])[0].ok
        res = d.pull("r", "P", [[3, 4, 5]], [[10, 11, 12]])
        assert res.ok, res
        for name in pc:
            assert torch.equal(dc[name][3:6], pc[name][10:13])
            assert not dc[name][:3].any() and not dc[name][6:].any()
        # the agent's /metrics over HTTP: one more successful handshake, the pulled bytes
        after = _scrape(d.metrics_port)
        ok = 'kvbridge_agent_handshakes_total{result="succeeded"}'
        assert after[ok] - before.get(ok, 0.0) >= 1
        moved = after["kvbridge_agent_transfer_bytes_total"] - before.get(
            "kvbridge_agent_transfer_bytes_total", 0.0)
        assert moved == res.nbytes == 3 * 3 * BS * 576 * 2
        assert after["kvbridge_agent_transfer_seconds_count"] >= 1
    finally:
        d.close()
        p.close()


def test_hisparse_style_decode_pulls_region_mapped_and_mixed_byte_exact() -> None:
    """D keeps layer 2 in a DRAM host pool of another group and capacity; P is uniform.

    The pull takes the region-mapped path (different group layouts) and splits into one
    part per memory-type pair; every region lands where its own block ids say.
    """
    try:
        load_nixl()
    except NixlUnavailableError:  # pragma: no cover
        pytest.skip("NIXL is not installed")
    settings = AgentSettings(mem_types=CPU_TEST_MEM_TYPES, epoch=1, transfer_timeout_s=5.0)
    common = {"compat": HASH, "is_mla": True, "attn_backend_name": "FLASHMLA",
              "kv_cache_layout": "HND", "device_mem_type": "VRAM"}
    pc = mla_caches(True)
    dc = mla_caches(False)
    dc[HOST_LAYER] = torch.zeros(48, BS, 576, dtype=torch.bfloat16)
    p = start_agent(VllmRegistration(kv_caches=pc, engine_id="P", role="prefill", **common),
                    settings=settings, publish=False)
    d = start_agent(VllmRegistration(kv_caches=dc, engine_id="D", role="decode",
                                     layer_groups={HOST_LAYER: 1}, host_resident_groups={1},
                                     host_num_blocks=48, **common),
                    settings=settings, publish=False)
    try:
        assert d.set_peers([PeerRef("p", "P", "127.0.0.1", p.port, 0, 1, 1)])[0].ok
        assert p.set_peers([PeerRef("d", "D", "127.0.0.1", d.port, 0, 1, 1)])[0].ok
        p.hold(["r"])
        res = d.pull("r", "P", [[3, 4, 5], [40, 41, 42]], [[10, 11, 12]])
        assert res.ok, res
        assert res.parts == 2          # (VRAM <- VRAM) and (DRAM <- VRAM)
        finished: list[str] = []
        deadline = time.monotonic() + 10
        while not finished and time.monotonic() < deadline:
            finished = p.completions()["finished"]
            time.sleep(0.01)
        assert finished == ["r"]       # exactly one notification, after both parts
        for name in pc:
            got = dc[name][40:43] if name == HOST_LAYER else dc[name][3:6]
            assert torch.equal(got, pc[name][10:13]), name
        assert not dc[HOST_LAYER][:40].any() and not dc[HOST_LAYER][43:].any()
        for name in mla_caches(False):
            if name != HOST_LAYER:
                assert not dc[name][:3].any() and not dc[name][6:].any()
    finally:
        d.close()
        p.close()
