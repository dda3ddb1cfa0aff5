"""Real VRAM: registration with the production mem-type map, VRAM<-VRAM and mixed
DRAM/VRAM pulls. Needs a CUDA GPU (skipped here with the reason from tests/conftest.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.nixl]

BLOCKS, BLOCK_LEN = 16, 4096
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _engine(name, tensors):
    from kvbridge_agent.geometry import CacheView
    from kvbridge_agent.nixl import (
        PRODUCTION_MEM_TYPES,
        AgentConfig,
        EngineFacts,
        LocalEngine,
        NixlAgent,
    )

    agent = NixlAgent(name, AgentConfig(mem_types=PRODUCTION_MEM_TYPES))
    views = [CacheView.from_tensor(n, t, group_id=0) for n, t in tensors.items()]
    return agent, LocalEngine(agent, views, EngineFacts(name))


@pytest.mark.parametrize("d_kinds", [("cuda",) * 4, ("cuda", "cpu", "cuda", "cpu")])
def test_vram_pull_and_mixed_split(d_kinds):
    torch = pytest.importorskip("torch")
    from kvbridge_agent.nixl import CompletionTracker, PullEngine, PullRequest, TransferDone

    gen = torch.Generator(device="cpu").manual_seed(0)
    src = {n: torch.randint(0, 256, (BLOCKS, BLOCK_LEN), dtype=torch.uint8, generator=gen)
           .to("cuda") for n in NAMES}
    dst = {n: (torch.zeros((BLOCKS, BLOCK_LEN), dtype=torch.uint8, device="cuda")
               if kind == "cuda" else
               torch.zeros((BLOCKS, BLOCK_LEN), dtype=torch.uint8).pin_memory())
           for n, kind in zip(NAMES, d_kinds, strict=True)}
    p_agent, p_local = _engine("gpu-p", src)
    d_agent, d_local = _engine("gpu-d", dst)
    try:
        assert set(p_local.plan.mem_types) == {"VRAM"}
        p_agent.add_remote(d_agent.metadata())
        tracker = CompletionTracker()
        tracker.register("g1")
        engine = PullEngine(d_local, timeout_s=10.0)
        engine.add_remote(p_local.describe())
        engine.start(PullRequest("g1", "gpu-p", [[1, 2, 9]], [[4, 5, 6]]))
        res = engine.wait("g1", 10.0)
        assert isinstance(res, TransferDone), res
        assert res.parts == len(set(d_kinds))
        torch.cuda.synchronize()
        for n in NAMES:
            got = dst[n].cpu().numpy()
            want = src[n].cpu().numpy()
            for lb, rb in ((1, 4), (2, 5), (9, 6)):
                np.testing.assert_array_equal(got[lb], want[rb])
            assert not np.delete(got, [1, 2, 9], axis=0).any()
        deadline = time.monotonic() + 5
        while "g1" not in tracker.take_finished():
            assert time.monotonic() < deadline
            tracker.poll(p_agent)
        engine.close()
    finally:
        d_agent.close()
        p_agent.close()
