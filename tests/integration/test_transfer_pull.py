"""Pull (READ) transfers between real processes: byte-exact, every layout of spec §4."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _peers import (
    SENTINEL,
    EngineSpec,
    Memory,
    Pair,
    Peer,
    RegionSpec,
    block_copies,
)

from kvbridge_agent.nixl import FailureCause, PullEngine, PullRequest, TransferDone

pytestmark = pytest.mark.nixl

_ids = itertools.count()


def _spec(prefix: str, regions: tuple[RegionSpec, ...], **kw) -> EngineSpec:
    n = next(_ids)
    return EngineSpec(engine_id=f"{prefix}-{n}", regions=regions, **kw)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _regions(n, *, groups=(0,), blocks=16, block_len=256, stride=None, mem=("VRAM",),
             caps=None, prefix="model.layers"):
    return tuple(
        RegionSpec(f"{prefix}.{i}.attn", group_id=groups[i % len(groups)],
                   num_blocks=caps[i] if caps else blocks, block_len=block_len,
                   block_stride=stride, mem_type=mem[i % len(mem)])
        for i in range(n))


def test_read_scattered_blocks_across_many_regions(peer):
    regions = _regions(24, blocks=32, block_len=192, stride=320)   # interleaved: gaps
    p_spec = _spec("p", regions, seed=11)
    d_spec = _spec("d", regions)
    pair = Pair(peer, p_spec, d_spec)
    try:
        rng = np.random.default_rng(5)
        local = rng.choice(32, 11, replace=False).tolist()
        remote = rng.choice(32, 11, replace=False).tolist()
        before, res = pair.pull("req-scatter", [local], [remote])
        assert isinstance(res, TransferDone), res
        assert res.parts == 1 and res.descs == 24 * 11
        pair.assert_bytes(before, block_copies(
            d_spec, p_spec, {r.name: list(zip(local, remote, strict=True)) for r in regions}))
        state = pair.notifs("req-scatter")
        assert [m for _, m in state["log"]] == ["req-scatter:1"]
    finally:
        pair.close()


def test_grouped_and_shared_region(peer):
    # groups 0/1 alternate; layers.9 is a second view of layers.8's storage in group 1,
    # which makes region 8 shared (-1): it receives both groups' blocks.
    base = _regions(8, groups=(0, 1), blocks=12, block_len=128)
    shared = (RegionSpec("model.layers.8.attn", group_id=0, num_blocks=12, block_len=128),
              RegionSpec("model.layers.9.attn", group_id=1, num_blocks=12, block_len=128,
                         alias_of="model.layers.8.attn"))
    regions = base + shared
    p_spec = _spec("p", regions, seed=3)
    d_spec = _spec("d", regions)
    pair = Pair(peer, p_spec, d_spec)
    try:
        assert pair.d.local.group_ids == (0, 1, 0, 1, 0, 1, 0, 1, -1)
        g0_l, g0_r = [1, 4, 7], [2, 3, 9]
        g1_l, g1_r = [0, 11], [5, 6]
        before, res = pair.pull("req-groups", [g0_l, g1_l], [g0_r, g1_r])
        assert isinstance(res, TransferDone), res
        pairs = {}
        for i, r in enumerate(base):
            pairs[r.name] = list(zip(*((g0_l, g0_r) if i % 2 == 0 else (g1_l, g1_r)),
                                     strict=True))
        pairs["model.layers.8.attn"] = list(zip(g0_l + g1_l, g0_r + g1_r, strict=True))
        pair.assert_bytes(before, block_copies(d_spec, p_spec, pairs))
        pair.notifs("req-groups")
    finally:
        pair.close()


def test_prefix_hit_trims_and_full_hit_only_notifies(peer):
    regions = _regions(3, blocks=10)
    p_spec = _spec("p", regions, seed=4)
    d_spec = _spec("d", regions)
    pair = Pair(peer, p_spec, d_spec)
    try:
        # D already has the first two blocks: it reads P's last two into its two.
        before, res = pair.pull("req-prefix", [[6, 7]], [[1, 2, 3, 4]])
        assert isinstance(res, TransferDone), res
        pair.assert_bytes(before, block_copies(
            d_spec, p_spec, {r.name: [(6, 3), (7, 4)] for r in regions}))
        pair.notifs("req-prefix")
        before, res = pair.pull("req-full-hit", [[]], [[1, 2]])
        assert isinstance(res, TransferDone) and res.parts == 0, res
        pair.assert_bytes(before, {})
        state = pair.notifs("req-full-hit")
        assert [m for _, m in state["log"]].count("req-full-hit:1") == 1
    finally:
        pair.close()


def test_region_mapped_pure_mla_with_different_layouts_and_capacities(peer):
    # Spec §3.9 example E: D splits region 2 into its own group with a larger pool.
    names = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")
    p_regions = tuple(RegionSpec(n, group_id=0, num_blocks=16, block_len=64) for n in names)
    d_regions = (RegionSpec(names[0], group_id=0, num_blocks=20, block_len=64),
                 RegionSpec(names[1], group_id=0, num_blocks=20, block_len=64),
                 RegionSpec(names[2], group_id=1, num_blocks=64, block_len=64))
    p_spec = _spec("p", p_regions, seed=6)
    d_spec = _spec("d", d_regions)
    pair = Pair(peer, p_spec, d_spec)
    try:
        before, res = pair.pull("req-rmap", [[10, 11, 12], [40, 41]], [[3, 4, 5, 6]])
        assert isinstance(res, TransferDone), res
        pair.assert_bytes(before, block_copies(d_spec, p_spec, {
            names[0]: [(10, 4), (11, 5), (12, 6)],
            names[1]: [(10, 4), (11, 5), (12, 6)],
            names[2]: [(40, 5), (41, 6)],
        }))
        pair.notifs("req-rmap")
    finally:
        pair.close()


def test_region_mapped_requires_pure_mla(peer):
    names = ("model.layers.0.attn", "model.layers.1.attn")
    p_regions = tuple(RegionSpec(n, group_id=0, num_blocks=8, block_len=64, is_mla=False)
                      for n in names)
    d_regions = (RegionSpec(names[0], group_id=0, num_blocks=8, block_len=64, is_mla=False),
                 RegionSpec(names[1], group_id=1, num_blocks=8, block_len=64, is_mla=False))
    pair = Pair(peer, _spec("p", p_regions), _spec("d", d_regions))
    try:
        before, res = pair.pull("req-not-mla", [[1], [2]], [[3]])
        assert res.cause is FailureCause.UNSUPPORTED
        assert "only supported for pure MLA" in res.message
        pair.assert_bytes(before, {})
    finally:
        pair.close()


def test_block_size_ratio_reads_sub_blocks(peer):
    # P kernel blocks of 16 tokens (128 B), D of 32 tokens (256 B): k = 2.
    names = [f"model.layers.{i}.attn" for i in range(4)]
    p_spec = _spec("p", tuple(RegionSpec(n, num_blocks=16, block_len=128) for n in names),
                   block_size=16, seed=8)
    d_spec = _spec("d", tuple(RegionSpec(n, num_blocks=8, block_len=256) for n in names),
                   block_size=32)
    pair = Pair(peer, p_spec, d_spec)
    try:
        # D logical blocks [2, 5] <- P blocks [4, 5, 10] (3 remote blocks: the second half
        # of D's block 5 is not read; the receiver zeroes it, spec §4.9).
        before, res = pair.pull("req-k2", [[2, 5]], [[4, 5, 10]])
        assert isinstance(res, TransferDone), res
        assert res.zeroed_bytes == 4 * 128
        copies = {n: [(2 * 256, 4 * 128, 128), (2 * 256 + 128, 5 * 128, 128),
                      (5 * 256, 10 * 128, 128)] for n in names}
        pair.assert_bytes(before, copies, zeros={n: [(5 * 256 + 128, 128)] for n in names})
        pair.notifs("req-k2")
    finally:
        pair.close()


def test_ppl_expands_logical_ids_on_each_side(peer):
    names = [f"model.layers.{i}.attn" for i in range(3)]
    p_spec = _spec("p", tuple(RegionSpec(n, num_blocks=24, block_len=64) for n in names),
                   ppl=2, seed=9)
    d_spec = _spec("d", tuple(RegionSpec(n, num_blocks=24, block_len=64) for n in names),
                   ppl=2)
    pair = Pair(peer, p_spec, d_spec)
    try:
        before, res = pair.pull("req-ppl", [[1, 7]], [[3, 10]])
        assert isinstance(res, TransferDone), res
        pair.assert_bytes(before, block_copies(d_spec, p_spec, {
            n: [(2, 6), (3, 7), (14, 20), (15, 21)] for n in names}))
        pair.notifs("req-ppl")
    finally:
        pair.close()


def test_coalesced_contiguous_read_is_byte_exact(peer):
    regions = _regions(6, blocks=64, block_len=512)
    p_spec = _spec("p", regions, seed=12)
    d_spec = _spec("d", regions)
    pair = Pair(peer, p_spec, d_spec, coalesce=True)
    try:
        local = [*list(range(10, 30)), 40, 42]
        remote = [*list(range(0, 20)), 50, 51]
        before, res = pair.pull("req-coalesce", [local], [remote])
        assert isinstance(res, TransferDone), res
        assert res.descs < len(local) * len(regions) // 2   # merged runs
        pair.assert_bytes(before, block_copies(
            d_spec, p_spec, {r.name: list(zip(local, remote, strict=True)) for r in regions}))
        pair.notifs("req-coalesce")
    finally:
        pair.close()


def test_untouched_buffers_keep_the_sentinel(peer):
    regions = _regions(2, blocks=4)
    pair = Pair(peer, _spec("p", regions), _spec("d", regions))
    try:
        _before, res = pair.pull("req-one", [[3]], [[0]])
        assert isinstance(res, TransferDone)
        for name, buf in pair.d.memory.buffers.items():
            assert (buf[: 3 * 256] == SENTINEL).all(), name
    finally:
        pair.close()


def test_torch_cpu_tensors_are_accepted_as_views(peer):
    torch = pytest.importorskip("torch")
    from kvbridge_agent.geometry import CacheView
    from kvbridge_agent.nixl import (
        CPU_TEST_MEM_TYPES,
        AgentConfig,
        EngineFacts,
        LocalEngine,
        NixlAgent,
    )

    regions = _regions(3, blocks=8, block_len=64)
    tensors = {r.name: torch.full((8, 64), SENTINEL, dtype=torch.uint8) for r in regions}
    # bf16 views of the same storage: block_len comes from shape and element size.
    views = [CacheView.from_tensor(n, t.view(torch.bfloat16), group_id=0)
             for n, t in tensors.items()]
    assert {v.mem_type for v in views} == {"DRAM"} and views[0].block_len == 64

    p2 = _spec("p", regions, seed=14)
    p2_desc = peer.call("create", p2)
    agent = NixlAgent("torch-d2", AgentConfig(mem_types=CPU_TEST_MEM_TYPES))
    try:
        local = LocalEngine(agent, views, EngineFacts("torch-d2"))
        engine = PullEngine(local, timeout_s=10)
        engine.add_remote(p2_desc)
        peer.call("add_peer", p2.engine_id, local.describe())
        engine.start(PullRequest("torch-1", p2.engine_id, [[0, 5]], [[7, 2]]))
        assert isinstance(engine.wait("torch-1"), TransferDone)
        mirror = Memory(p2)
        mirror.fill_pattern(p2.seed)
        for name, t in tensors.items():
            got = t.numpy()
            src = mirror.buffer(name).reshape(8, 64)
            np.testing.assert_array_equal(got[0], src[7])
            np.testing.assert_array_equal(got[5], src[2])
            assert (np.delete(got, [0, 5], axis=0) == SENTINEL).all()
        engine.close()
    finally:
        agent.close()
        peer.call("close", p2.engine_id)


def test_vram_registration_of_host_memory_is_a_typed_error():
    from kvbridge_agent.nixl import (
        PRODUCTION_MEM_TYPES,
        AgentConfig,
        EngineFacts,
        LocalEngine,
        NixlAgent,
        NixlCallError,
    )

    mem = Memory(_spec("v", _regions(1, blocks=4)))
    with NixlAgent("vram-on-cpu", AgentConfig(mem_types=PRODUCTION_MEM_TYPES)) as agent:
        with pytest.raises(NixlCallError, match=r"register_memory\(1 VRAM ranges as VRAM\)") as e:
            LocalEngine(agent, mem.views(), EngineFacts("v"))
        assert e.value.cause is FailureCause.SETUP
