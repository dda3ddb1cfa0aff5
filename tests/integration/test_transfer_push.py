"""Push (WRITE) transfers: the producer process writes into this process's memory, with the
completion notification attached; the spec's push rejections (spec §5)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from _peers import EngineSpec, LocalSide, Memory, Peer, RegionSpec, block_copies, expected_after

from kvbridge_agent.nixl import (
    CompletionTracker,
    PushEngine,
    PushRequest,
    UnsupportedTransferError,
)

pytestmark = pytest.mark.nixl

_n = itertools.count()


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def _regions(n, groups=(0,), blocks=16, block_len=200, stride=256, mem="VRAM"):
    return tuple(RegionSpec(f"model.layers.{i}.attn", group_id=groups[i % len(groups)],
                            num_blocks=blocks, block_len=block_len, block_stride=stride,
                            mem_type=mem) for i in range(n))


def _spec(prefix, regions, **kw):
    return EngineSpec(f"{prefix}-{next(_n)}", regions, **kw)


def _wait_finished(tracker, agent, rid, timeout=5.0):
    deadline = time.monotonic() + timeout
    finished: set[str] = set()
    while rid not in finished:
        assert time.monotonic() < deadline, f"no completion for {rid}"
        tracker.poll(agent)
        finished |= tracker.take_finished()
        time.sleep(0.005)


@pytest.mark.parametrize("coalesce", [False, True])
def test_write_scattered_blocks_grouped_layout(peer, coalesce):
    # With coalescing, blocks are dense (stride == len) so runs merge.
    regions = _regions(10, groups=(0, 1), blocks=24, block_len=256 if coalesce else 200)
    p_spec = _spec("pp", regions, seed=31)
    d_spec = _spec("pd", regions)
    d = LocalSide(d_spec)
    tracker = CompletionTracker(lease_s=30)
    try:
        peer.call("create", p_spec, role="push", coalesce=coalesce)
        p_desc = peer.call("add_peer", p_spec.engine_id, d.describe())
        assert p_desc == d_spec.name
        # D must know P's agent to accept its WRITE and notification.
        d.agent.add_remote(peer.call("metadata", p_spec.engine_id))
        tracker.register("push-1")
        before = d.memory.snapshot()
        g0_p, g0_d = [3, 4, 5, 6, 20], [10, 11, 12, 13, 0]
        g1_p, g1_d = [1, 2], [22, 23]
        res = peer.call("push", p_spec.engine_id,
                        PushRequest("push-1", d_spec.engine_id, [g0_p, g1_p], [g0_d, g1_d]))
        assert res["ok"], res
        _wait_finished(tracker, d.agent, "push-1")
        mirror = Memory(p_spec)
        mirror.fill_pattern(p_spec.seed)
        pairs = {r.name: list(zip(*((g0_d, g0_p) if i % 2 == 0 else (g1_d, g1_p)), strict=True))
                 for i, r in enumerate(regions)}
        want = expected_after(d.memory, before, mirror, block_copies(d_spec, p_spec, pairs))
        for name, buf in d.memory.buffers.items():
            np.testing.assert_array_equal(buf, want[name], err_msg=name)
        if coalesce:
            assert res["descs"] == 10 + 5      # one run per group-0 pair of runs, per region
        else:
            assert res["descs"] == 7 * 5
    finally:
        peer.call("close", p_spec.engine_id)
        d.close()


def test_push_rejects_mixed_memory():
    spec = _spec("px", (RegionSpec("model.layers.0.attn", mem_type="DRAM"),
                        RegionSpec("model.layers.1.attn", mem_type="VRAM")))
    side = LocalSide(spec)
    try:
        with pytest.raises(UnsupportedTransferError,
                           match="does not support mixed-memory KV caches"):
            PushEngine(side.local)
    finally:
        side.close()


def test_push_rejects_different_group_layouts():
    a = LocalSide(_spec("pa", _regions(2, groups=(0,))))
    b = LocalSide(_spec("pb", _regions(2, groups=(0, 1))))
    try:
        engine = PushEngine(a.local)
        with pytest.raises(UnsupportedTransferError,
                           match="different producer and consumer cache-group layouts"):
            engine.add_remote(b.describe())
        c = LocalSide(_spec("pc", (RegionSpec("model.layers.0.attn", mem_type="DRAM"),
                                   RegionSpec("model.layers.1.attn", mem_type="VRAM"))))
        try:
            with pytest.raises(UnsupportedTransferError, match="mixed-memory"):
                engine.add_remote(c.describe())
        finally:
            c.close()
        engine.close()
    finally:
        a.close()
        b.close()
