"""Zeroing of pages a pull allocated but did not read (spec §4.9, invariant §6.3.8), between
real processes: local memory starts as 0xAA; after a successful pull every byte of the
request's blocks is either read or zero, and every byte outside them is still 0xAA. A
failed pull zeroes nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _peers import EngineSpec, Pair, Peer, RegionSpec, block_copies

from kvbridge_agent.nixl import FailureCause, NixlCallError, TransferDone

pytestmark = pytest.mark.nixl

STALE = 0xAA
_ids = itertools.count()


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _pair(peer, p_regions, d_regions, *, p_kw=None, d_kw=None):
    n = next(_ids)
    p_spec = EngineSpec(f"zp-{n}", tuple(p_regions), seed=30 + n, **(p_kw or {}))
    d_spec = EngineSpec(f"zd-{n}", tuple(d_regions), **(d_kw or {}))
    pair = Pair(peer, p_spec, d_spec)
    pair.d.memory.fill(STALE)
    return pair


def _assert_clean(pair, owned, copies, zeros):
    """``copies`` and ``zeros`` together cover every byte of the ``owned`` blocks exactly,
    i.e. nothing of the request's blocks can keep stale bytes."""
    for name, blocks in owned.items():
        r = next(x for x in pair.d_spec.regions if x.name == name)
        want = np.zeros(r.num_blocks * r.stride, dtype=bool)
        for b in blocks:
            want[b * r.stride:b * r.stride + r.block_len] = True
        got = np.zeros_like(want)
        for off, _roff, n in copies.get(name, []):
            got[off:off + n] = True
        for off, n in zeros.get(name, []):
            got[off:off + n] = True
        np.testing.assert_array_equal(got, want, err_msg=f"coverage of {name}")


def _check(pair, before, res, owned, copies, zeros):
    assert isinstance(res, TransferDone), res
    assert res.zeroed_bytes == sum(n for z in zeros.values() for _, n in z)
    _assert_clean(pair, owned, copies, zeros)
    pair.assert_bytes(before, copies, zeros)   # exact; everything else still STALE


NAMES = [f"model.layers.{i}.attn" for i in range(4)]


@pytest.mark.parametrize("mem", [("VRAM",), ("VRAM", "DRAM")])
def test_block_size_ratio_tail_of_last_block_is_zeroed(peer, mem):
    # P kernel blocks of 128 B, D of 256 B (k = 2) with a 64-byte gap between D's blocks.
    # A prompt of 3 P blocks ends in the middle of D's second block.
    p_regions = [RegionSpec(n, num_blocks=16, block_len=128) for n in NAMES]
    d_regions = [RegionSpec(n, num_blocks=8, block_len=256, block_stride=320,
                            mem_type=mem[i % len(mem)]) for i, n in enumerate(NAMES)]
    pair = _pair(peer, p_regions, d_regions, p_kw={"block_size": 16}, d_kw={"block_size": 32})
    try:
        before, res = pair.pull("z-k2", [[2, 5]], [[4, 5, 10]])
        copies = {n: [(2 * 320, 4 * 128, 128), (2 * 320 + 128, 5 * 128, 128),
                      (5 * 320, 10 * 128, 128)] for n in NAMES}
        zeros = {n: [(5 * 320 + 128, 128)] for n in NAMES}
        _check(pair, before, res, {n: [2, 5] for n in NAMES}, copies, zeros)
        pair.notifs("z-k2")

        # Prefix hit: D already holds the first local block, only block 6 is read into;
        # remote block 10 fills its first half, the second half is zeroed.
        before, res = pair.pull("z-k2-hit", [[6]], [[4, 5, 10]])
        copies = {n: [(6 * 320, 10 * 128, 128)] for n in NAMES}
        zeros = {n: [(6 * 320 + 128, 128)] for n in NAMES}
        _check(pair, before, res, {n: [6] for n in NAMES}, copies, zeros)
    finally:
        pair.close()


def test_ppl_rounding_clipped_kernel_block_is_zeroed(peer):
    # Same kernel page, D has 2 kernel blocks per logical block and P 1: a 3-page prompt
    # is 3 kernel blocks on P but 4 on D; D's 4th kernel block is never read.
    p_regions = [RegionSpec(n, num_blocks=16, block_len=64) for n in NAMES[:3]]
    d_regions = [RegionSpec(n, num_blocks=16, block_len=64) for n in NAMES[:3]]
    pair = _pair(peer, p_regions, d_regions, d_kw={"ppl": 2})
    try:
        before, res = pair.pull("z-ppl", [[1, 3]], [[4, 5, 6]])
        copies = block_copies(pair.d_spec, pair.p_spec,
                              {n: [(2, 4), (3, 5), (6, 6)] for n in NAMES[:3]})
        zeros = {n: [(7 * 64, 64)] for n in NAMES[:3]}
        _check(pair, before, res, {n: [2, 3, 6, 7] for n in NAMES[:3]}, copies, zeros)
        pair.notifs("z-ppl")
    finally:
        pair.close()


def test_region_mapped_positional_padding_is_zeroed(peer):
    # D splits region 2 into group 1 (pure MLA, region-mapped read). The producer has 3
    # blocks of tokens (40 tokens, block size 16) but D allocated 4 pages per region.
    names = NAMES[:3]
    p_regions = [RegionSpec(n, group_id=0, num_blocks=16, block_len=64) for n in names]
    d_regions = [RegionSpec(names[0], group_id=0, num_blocks=20, block_len=64),
                 RegionSpec(names[1], group_id=0, num_blocks=20, block_len=64),
                 RegionSpec(names[2], group_id=1, num_blocks=64, block_len=64)]
    pair = _pair(peer, p_regions, d_regions)
    try:
        before, res = pair.pull("z-rmap", [[10, 11, 12, 13], [40, 41, 42, 43]],
                                [[3, 4, 5, 6]], num_computed_blocks=[0, 0],
                                remote_num_tokens=40)
        copies = block_copies(pair.d_spec, pair.p_spec, {
            names[0]: [(10, 3), (11, 4), (12, 5)],
            names[1]: [(10, 3), (11, 4), (12, 5)],
            names[2]: [(40, 3), (41, 4), (42, 5)]})
        zeros = {names[0]: [(13 * 64, 64)], names[1]: [(13 * 64, 64)],
                 names[2]: [(43 * 64, 64)]}
        owned = {names[0]: [10, 11, 12, 13], names[1]: [10, 11, 12, 13],
                 names[2]: [40, 41, 42, 43]}
        _check(pair, before, res, owned, copies, zeros)
        pair.notifs("z-rmap")
    finally:
        pair.close()


def test_fully_covered_read_zeroes_nothing(peer):
    regions = [RegionSpec(n, num_blocks=8, block_len=64) for n in NAMES[:2]]
    pair = _pair(peer, regions, regions)
    try:
        before, res = pair.pull("z-none", [[1, 2]], [[0, 1, 5, 6]])   # prefix hit on D
        copies = block_copies(pair.d_spec, pair.p_spec,
                              {n: [(1, 5), (2, 6)] for n in NAMES[:2]})
        _check(pair, before, res, {n: [1, 2] for n in NAMES[:2]}, copies, {})
    finally:
        pair.close()


@pytest.mark.parametrize("where", ["post", "state"])
def test_failed_pull_zeroes_nothing(peer, where):
    p_regions = [RegionSpec(n, num_blocks=16, block_len=128) for n in NAMES]
    d_regions = [RegionSpec(n, num_blocks=8, block_len=256) for n in NAMES]
    pair = _pair(peer, p_regions, d_regions, p_kw={"block_size": 16}, d_kw={"block_size": 32})
    agent = pair.d.agent
    real_post, real_state = agent.post, agent.state

    def post(x, notif=b""):
        if where == "post":
            raise NixlCallError("injected post failure", FailureCause.TRANSFER)
        real_post(x, notif)
        from kvbridge_agent.nixl import XferState
        return XferState.IN_PROGRESS           # the copy is done, but we are not told yet

    def state(x):
        raise NixlCallError("injected status error", FailureCause.TRANSFER)

    agent.post, agent.state = post, state
    try:
        _before, res = pair.pull("z-fail", [[2, 5]], [[4, 5, 10]])
        assert res.cause is FailureCause.TRANSFER and "injected" in res.message, res
        for name, buf in pair.d.memory.buffers.items():
            tail = buf[5 * 256 + 128:6 * 256]
            assert (tail == STALE).all(), f"{name}: a failed pull zeroed pages"
    finally:
        agent.post, agent.state = real_post, real_state
        pair.close()


def test_zeroing_error_fails_the_request_after_notifying(peer):
    p_regions = [RegionSpec(n, num_blocks=16, block_len=128) for n in NAMES[:2]]
    d_regions = [RegionSpec(n, num_blocks=8, block_len=256) for n in NAMES[:2]]
    pair = _pair(peer, p_regions, d_regions, p_kw={"block_size": 16}, d_kw={"block_size": 32})

    def broken(ranges):
        raise RuntimeError("device gone")

    pair.d.local.zero = broken
    try:
        _before, res = pair.pull("z-broken", [[2, 5]], [[4, 5, 10]])
        assert res.cause is FailureCause.ZEROING and "device gone" in res.message, res
        state = pair.notifs("z-broken")          # the producer's blocks were fully read
        assert [m for _, m in state["log"]] == ["z-broken:1"]
    finally:
        pair.close()


# -- the one zeroing function, per memory type ---------------------------------------------


def _rows(buf, ranges, device=0):
    base = buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()
    return np.array([(base + off, n, device) for off, n in ranges], dtype=np.uint64)


def test_zero_ranges_dram_zeroes_exactly_the_ranges():
    from kvbridge_agent.nixl._zeroing import zero_ranges

    buf = np.full(4096, STALE, dtype=np.uint8)
    assert zero_ranges(_rows(buf, [(0, 1), (100, 28), (4000, 96)]), "DRAM") == 125
    want = np.full(4096, STALE, dtype=np.uint8)
    want[0:1] = want[100:128] = want[4000:4096] = 0
    np.testing.assert_array_equal(buf, want)
    assert zero_ranges(np.empty((0, 3), dtype=np.uint64), "DRAM") == 0


def test_zero_ranges_rejects_bad_input():
    from kvbridge_agent.nixl._zeroing import zero_ranges

    buf = np.full(64, STALE, dtype=np.uint8)
    with pytest.raises(ValueError, match="NIXL type 'BLK'"):
        zero_ranges(_rows(buf, [(0, 8)]), "BLK")
    with pytest.raises(ValueError, match=r"\(N, 3\) rows"):
        zero_ranges(np.zeros((2, 2), dtype=np.uint64), "DRAM")
    assert (buf == STALE).all()


@pytest.mark.gpu
def test_zero_ranges_vram_zeroes_device_memory_in_place():
    torch = pytest.importorskip("torch")
    from kvbridge_agent.nixl._zeroing import zero_ranges

    dev = torch.cuda.current_device()
    t = torch.full((1 << 16,), STALE, dtype=torch.uint8, device=f"cuda:{dev}")
    ranges = [(0, 1), (4096, 4096), (65536 - 100, 100)]
    assert zero_ranges(_rows(t, ranges, dev), "VRAM") == 4197
    torch.cuda.synchronize()
    want = np.full(1 << 16, STALE, dtype=np.uint8)
    for off, n in ranges:
        want[off:off + n] = 0
    np.testing.assert_array_equal(t.cpu().numpy(), want)


def test_zero_ranges_vram_without_cuda_is_a_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the gpu test covers VRAM")
    from kvbridge_agent.nixl._zeroing import zero_ranges

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        zero_ranges(np.array([[4096, 8, 0]], dtype=np.uint64), "VRAM")
