"""Pure pieces of the data plane (no NIXL agent): wire formats, completion accounting and
leases on a fake clock, heartbeats, coalescing, id planning, the mem-type map, the loader."""

from __future__ import annotations

import builtins
import logging

import numpy as np
import pytest

import kvbridge_agent.nixl as nx
from kvbridge_agent import geometry as geo
from kvbridge_agent.nixl import (
    CompletionTracker,
    HeartbeatSender,
    NotificationError,
    RemoteEngine,
    UnsupportedTransferError,
    completion_message,
    heartbeat_message,
    parse_notification,
    plan_read_ids,
)
from kvbridge_agent.nixl._coalesce import coalesce_rows


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_public_names_are_pinned():
    assert set(nx.__all__) == {
        "CPU_TEST_MEM_TYPES", "DEFAULT_COALESCE", "DEFAULT_LEASE_S", "HEARTBEAT_PREFIX",
        "LOCAL_AGENT", "PRODUCTION_MEM_TYPES", "AgentConfig", "Completion", "CompletionTracker",
        "DList",
        "DataPlaneError", "EngineFacts", "FailureCause", "Heartbeat", "HeartbeatSender",
        "LocalEngine", "LocalLists", "MemTypeMap", "NixlAgent", "NixlCallError",
        "NixlUnavailableError", "NotificationError", "PeerTransport", "PollResult", "PullEngine",
        "PullRequest", "PushEngine", "PushRequest", "ReadIds", "ReleaseReason",
        "RemoteEngine", "RemoteNotFoundError", "RequestState", "TransferDone", "TransferEngine",
        "TransferFailure", "UnsupportedTransferError", "XferHandle", "XferState",
        "completion_message", "heartbeat_extension_s", "heartbeat_message", "load_nixl",
        "parse_notification",
        "plan_read_ids",
    }


# -- wire formats -------------------------------------------------------------------------
def test_notification_round_trip_and_errors():
    assert completion_message("req-1", 2) == b"req-1:2"
    assert parse_notification(b"req-1:2") == nx.Completion("req-1", 2)
    assert parse_notification(b"cmpl:abc:4") == nx.Completion("cmpl:abc", 4)
    assert heartbeat_message(["a", "b"]) == b"HB:a,b"
    assert parse_notification(b"HB:a,b") == nx.Heartbeat(("a", "b"))
    for bad in (b"no-count", b"req:0", b"req:x", b":3", b"\xff:1"):
        with pytest.raises(NotificationError):
            parse_notification(bad)
    with pytest.raises(ValueError, match="consumers"):
        completion_message("r", 0)


# -- producer side ------------------------------------------------------------------------
def test_tracker_frees_after_the_announced_count():
    clock = Clock()
    released = []
    t = CompletionTracker(lease_s=30, clock=clock, on_release=lambda r, why: released.append(
        (r, why)))
    t.register("r1")
    t.process({"d0": [b"r1:2"]})
    assert t.take_finished() == set() and t.received("r1") == 1
    t.process({"d1": [b"r1:2"]})
    assert t.take_finished() == {"r1"} and released == [("r1", "completed")]
    assert t.pending() == ()


def test_tracker_heartbeat_extends_to_max_and_expiry_frees(caplog):
    clock = Clock()
    t = CompletionTracker(lease_s=30, clock=clock)
    t.register("r1")                       # expires at 1030
    t.register("r2")
    clock.t += 5
    t.process({"d": [b"HB:r1"]})           # max(1030, 1005 + 20) = 1030: unchanged
    assert t.expiry("r1") == 1030
    clock.t += 15
    t.process({"d": [b"HB:r1,zzz"]})       # max(1030, 1020 + 20) = 1040
    assert t.expiry("r1") == 1040
    clock.t = 1030
    assert t.expire() == ["r2"] and t.take_expired() == {"r2"}
    clock.t = 1040
    assert t.expire() == ["r1"]
    with caplog.at_level(logging.WARNING):
        t.process({"d": [b"r1:1", b"r1:1", b"garbage"]})  # unknown: logged once, ignored
    assert sum("unknown request 'r1'" in r.getMessage() for r in caplog.records) == 1
    assert t.take_finished() == set() and t.bad_notifications == 1


def test_heartbeat_sender_period_and_failures():
    clock = Clock()
    sent = []
    hb = HeartbeatSender(lambda peer, m: sent.append((peer, m)), lease_s=30, clock=clock)
    hb.track("p0", "a")
    hb.track("p0", "b")
    hb.track("p1", "c")
    assert hb.tick() == 0                  # first period (5 s) not over
    clock.t += 5
    assert hb.tick() == 2
    assert sorted(sent) == [("p0", b"HB:a,b"), ("p1", b"HB:c")]
    hb.untrack("c")
    clock.t += 5
    assert hb.tick() == 1

    def boom(peer, m):
        raise RuntimeError("peer gone")

    hb2 = HeartbeatSender(boom, clock=clock)
    hb2.track("p", "x")
    assert hb2.tick(force=True) == 0 and hb2.failures == 1


# -- coalescing ---------------------------------------------------------------------------
def _rows(addrs, length=16, dev=0):
    a = np.asarray(addrs, dtype=np.uint64)
    return np.stack([a, np.full_like(a, length), np.full_like(a, dev)], axis=1)


def test_coalesce_merges_only_runs_adjacent_on_both_sides():
    local = _rows([0, 16, 32, 100, 116, 200])
    remote = _rows([1000, 1016, 1040, 2000, 2016, 3000])
    lo, ro = coalesce_rows(local, remote)
    assert lo[:, 0].tolist() == [0, 32, 100, 200] and lo[:, 1].tolist() == [32, 16, 32, 16]
    assert ro[:, 0].tolist() == [1000, 1040, 2000, 3000] and ro[:, 1].tolist() == lo[:, 1].tolist()
    # Every byte pair of the input is still covered, in order.
    def expand(rows):
        return np.concatenate([np.arange(a, a + n) for a, n, _ in rows.tolist()])
    np.testing.assert_array_equal(expand(lo), expand(local))
    np.testing.assert_array_equal(expand(ro), expand(remote))
    same_l, same_r = coalesce_rows(_rows([0, 32]), _rows([0, 16]))
    assert same_l.shape[0] == 2 and same_r.shape[0] == 2


# -- id planning ---------------------------------------------------------------------------
def _plan(group_ids, caps, *, is_mla=True, block_len=64):
    views = [geo.CacheView.from_range(
        f"model.layers.{i}.attn", (i + 1) * (1 << 24), c * block_len,
        group_id=g, num_blocks=c, mem_type="VRAM", block_len=block_len, is_mla=is_mla)
        for i, (g, c) in enumerate(zip(group_ids, caps, strict=True))]
    return geo.plan_regions(views)


def _remote(group_ids, caps, *, block_size=16, ppl=1, block_len=64):
    r = len(caps)
    return RemoteEngine(
        engine_id="p", agent_metadata=b"", tp_rank=0, tp_size=1, num_blocks=max(caps),
        block_size=block_size, ppl=ppl, device_id=0,
        base_addrs=tuple((i + 1) << 30 for i in range(r)), block_lens=(block_len,) * r,
        block_strides=(block_len,) * r, region_num_blocks=tuple(caps),
        region_group_ids=tuple(group_ids), region_mem_types=("VRAM",) * r)


def test_plan_region_mapped_matches_spec_example_e():
    ids = plan_read_ids(_plan([0, 0, 1], [20, 20, 64]), local_block_size=16, local_ppl=1,
                        remote=_remote([0, 0, 0], [16, 16, 16]),
                        local_block_ids=[[10, 11, 12], [40, 41]],
                        remote_block_ids=[[3, 4, 5, 6]])
    assert ids.region_mapped and ids.k == 1
    assert ids.local_ids.tolist() == [10, 11, 12, 30, 31, 32, 80, 81]
    assert ids.remote_ids.tolist() == [4, 5, 6, 20, 21, 22, 37, 38]


def test_plan_block_size_ratio_with_prefix_hit_keeps_token_alignment():
    # 5 remote blocks of 16 tokens (80 tokens) = 3 local blocks of 32; local block 0 is a
    # prefix hit, so local blocks [6, 7] receive remote blocks 2..4 (tokens 32..79):
    # sub-blocks 12, 13 (block 6) and 14 (first half of block 7), nothing more.
    ids = plan_read_ids(_plan([0], [8], block_len=128), local_block_size=32, local_ppl=1,
                        remote=_remote([0], [8]), local_block_ids=[[6, 7]],
                        remote_block_ids=[[0, 1, 2, 3, 4]])
    assert ids.k == 2
    assert ids.local_ids.tolist() == [12, 13, 14]
    assert ids.remote_ids.tolist() == [2, 3, 4]


def test_plan_with_cached_layouts_gives_the_same_ids_and_allocated_ids():
    from kvbridge_agent.nixl._readplan import local_desc_layout, remote_desc_layout

    cases = [
        (_plan([0, 0, 1], [20, 20, 64]), _remote([0, 0, 0], [16, 16, 16]), 16,
         [[10, 11, 12, 13], [40, 41, 42, 43]], [[3, 4, 5, 6]],
         {"num_computed_blocks": [0, 0], "remote_num_tokens": 40}),
        (_plan([0, 1, 0], [8, 8, 8], block_len=128), _remote([0, 1, 0], [8, 8, 8]), 32,
         [[6, 7], [1]], [[0, 1, 2, 3, 4], [5, 6]], {}),
    ]
    for plan, remote, bs, lids, rids, kw in cases:
        cache: dict = {}

        def local_layout(k, mapped, plan=plan, cache=cache):
            return cache.setdefault((k, mapped), local_desc_layout(plan, k, mapped))

        args = {"local_block_size": bs, "local_ppl": 1, "remote": remote,
                "local_block_ids": lids, "remote_block_ids": rids, **kw}
        fresh = plan_read_ids(plan, **args)
        for _ in range(2):
            cached = plan_read_ids(plan, **args, local_layout=local_layout,
                                   remote_layout=lambda m, r=remote: remote_desc_layout(r, m))
            assert cached.local_ids.tolist() == fresh.local_ids.tolist()
            assert cached.remote_ids.tolist() == fresh.remote_ids.tolist()
            assert cached.allocated_ids is not None
            assert cached.allocated_ids.tolist() == fresh.allocated_ids.tolist()
        assert len(cache) == 1


def test_plan_rejections():
    with pytest.raises(UnsupportedTransferError, match="pure MLA"):
        plan_read_ids(_plan([0, 1], [8, 8], is_mla=False), local_block_size=16, local_ppl=1,
                      remote=_remote([0, 0], [8, 8]), local_block_ids=[[1], [2]],
                      remote_block_ids=[[1]])
    with pytest.raises(UnsupportedTransferError, match="matching physical block sizes"):
        plan_read_ids(_plan([0, 1], [8, 8], block_len=128), local_block_size=32, local_ppl=1,
                      remote=_remote([0, 0], [8, 8]), local_block_ids=[[1], [2]],
                      remote_block_ids=[[1]])
    with pytest.raises(UnsupportedTransferError, match="not a multiple"):
        plan_read_ids(_plan([0], [8]), local_block_size=16, local_ppl=1,
                      remote=_remote([0], [8], block_size=24), local_block_ids=[[1]],
                      remote_block_ids=[[1]])
    with pytest.raises(geo.BlockIdRangeError):
        plan_read_ids(_plan([0], [8]), local_block_size=16, local_ppl=1,
                      remote=_remote([0], [8]), local_block_ids=[[9]], remote_block_ids=[[1]])


def test_remote_engine_from_v10_metadata_falls_back_to_uniform_geometry():
    from kvbridge_agent.protocol import NixlAgentMetadata

    meta = NixlAgentMetadata(
        engine_id="p", agent_metadata=b"blob", kv_caches_base_addr=[4096, 8192],
        device_id=-1, num_blocks=10, block_lens=[64, 64], block_strides=[64, 128],
        kv_cache_layout="HND", block_size=16, ssm_sizes=(0, 0), attn_backend_name="FLASH",
        physical_blocks_per_logical_kv_block=2)
    desc = RemoteEngine.from_metadata(meta, tp_rank=0, tp_size=1,
                                      local_region_group_ids=[0, 1], local_mem_type="DRAM")
    assert desc.region_num_blocks == (10, 10) and desc.region_group_ids == (0, 1)
    assert desc.region_mem_types == ("DRAM", "DRAM") and desc.device_id == 0 and desc.ppl == 2
    with pytest.raises(ValueError,
                       match=r"block_strides\[0\]: expected >= block_lens\[0\] \(64\), got 32"):
        RemoteEngine(**{**desc.__dict__, "block_strides": (32, 64)})


# -- configuration ------------------------------------------------------------------------
def test_mem_type_maps():
    assert nx.PRODUCTION_MEM_TYPES.nixl_type("VRAM") == "VRAM"
    assert nx.CPU_TEST_MEM_TYPES.nixl_type("VRAM") == "DRAM"
    assert nx.CPU_TEST_MEM_TYPES.device_id("VRAM", 3) == 0
    assert nx.PRODUCTION_MEM_TYPES.device_id("VRAM", 3) == 3
    with pytest.raises(ValueError, match="'FILE': not in mem-type map 'production'"):
        nx.PRODUCTION_MEM_TYPES.nixl_type("FILE")
    with pytest.raises(ValueError, match="progress_delay_us"):
        nx.AgentConfig(progress_delay_us=-1)


def test_loader_gives_a_clear_error_when_no_nixl(monkeypatch):
    from kvbridge_agent.nixl import _loader

    real_import = builtins.__import__
    monkeypatch.setattr(_loader, "_loaded", None)

    def fake_import_module(name):
        raise ImportError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(_loader.importlib, "import_module", fake_import_module)
    with pytest.raises(nx.NixlUnavailableError, match=r"nixl-cu12==1\.5\.1") as info:
        _loader.load_nixl()
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        assert name in str(info.value)
    assert builtins.__import__ is real_import


# -- in-flight state machine on a fake agent ------------------------------------------------
class FakeAgent:
    """Stands in for NixlAgent: parts stay IN_PROGRESS until told; release can refuse."""

    def __init__(self):
        from kvbridge_agent.nixl import XferState

        self.S = XferState
        self.done: set[str] = set()
        self.refuse_release: set[str] = set()
        self.refuse_post: set[str] = set()
        self.released: list[str] = []
        self.notifs: list[tuple[str, bytes]] = []

    def post(self, x, notif=b""):
        if x.label in self.refuse_post:
            raise nx.NixlCallError("post refused", nx.FailureCause.TRANSFER)
        return self.S.DONE if x.label in self.done else self.S.IN_PROGRESS

    def state(self, x):
        return self.S.DONE if x.label in self.done else self.S.IN_PROGRESS

    def release(self, x):
        if x.label in self.refuse_release:
            raise nx.NixlCallError("release refused", nx.FailureCause.TRANSFER)
        x.released = True
        self.released.append(x.label)

    def send_notif(self, peer, message):
        self.notifs.append((peer, message))


def _xfer(label):
    return nx.XferHandle(handle=None, label=label, peer="p", num_descs=1, nbytes=10)


def _transfers():
    """(clock, fake agent, Transfers over them)."""
    from kvbridge_agent.nixl._inflight import Transfers

    clock = Clock()
    agent = FakeAgent()
    return clock, agent, Transfers(agent, clock=clock)


def test_inflight_notifies_only_after_every_part_and_reports_once():
    clock, agent, t = _transfers()
    req = t.begin("r", clock() + 5)
    t.post(req, _xfer("a"))
    t.post(req, _xfer("b"))
    t.defer_notif(req, "p", b"r:1")
    t.seal(req)
    assert t.poll() == [] and agent.notifs == []
    agent.done.add("a")
    assert t.poll() == [] and agent.notifs == []
    agent.done.add("b")
    (res,) = t.poll()
    assert isinstance(res, nx.TransferDone) and res.parts == 2 and res.notified == ("p",)
    assert agent.notifs == [("p", b"r:1")] and sorted(agent.released) == ["a", "b"]
    assert t.poll() == [] and "r" not in t


def test_inflight_part_done_in_its_post_is_released_and_the_request_ends_at_seal():
    clock, agent, t = _transfers()
    agent.done.update({"a", "b"})
    req = t.begin("r", clock() + 5)
    t.post(req, _xfer("a"), b"r:1")             # the notification rides on the READ
    assert agent.released == ["a"]               # released inside the post
    assert t.poll() == [] and "r" in t           # not sealed: more parts may follow
    t.seal(req)
    (res,) = t.poll()
    assert isinstance(res, nx.TransferDone) and res.notified == ("p",) and res.nbytes == 10
    assert agent.notifs == [] and t.poll() == [] and "r" not in t
    req = t.begin("r2", clock() + 5)
    t.post(req, _xfer("b"))
    t.defer_notif(req, "q", b"r2:1")
    t.seal(req)
    assert agent.notifs == [("q", b"r2:1")]      # sent at once: every part is done
    res = t.wait("r2", clock() + 5)
    assert isinstance(res, nx.TransferDone) and res.notified == ("q",)
    with pytest.raises(KeyError):                # reported exactly once
        t.wait("r2", clock() + 5)


def test_inflight_failed_post_releases_its_handle_with_the_request():
    clock, agent, t = _transfers()
    agent.refuse_post.add("bad")
    req = t.begin("r", clock() + 5)
    t.post(req, _xfer("ok"))
    with pytest.raises(nx.NixlCallError):
        t.post(req, _xfer("bad"))
    t.fail(req, nx.FailureCause.TRANSFER, "post refused")
    assert sorted(agent.released) == ["bad", "ok"]
    (res,) = t.poll()
    assert res.cause is nx.FailureCause.TRANSFER and agent.notifs == []


def test_inflight_deadline_fails_releases_and_holds_refused_handles():
    clock, agent, t = _transfers()
    agent.refuse_release.add("stuck")
    req = t.begin("r", clock() + 5)
    t.post(req, _xfer("ok"))
    t.post(req, _xfer("stuck"))
    t.defer_notif(req, "p", b"r:1")
    t.seal(req)
    clock.t += 6
    assert t.poll() == []                       # failed, but "stuck" may still be running
    assert agent.released == ["ok"] and "r" in t
    agent.refuse_release.clear()
    (res,) = t.poll()
    assert res.cause is nx.FailureCause.TIMEOUT and "still in flight" in res.message
    assert agent.notifs == []                   # a failed request never notifies


def test_agent_construction_patches_the_progress_thread_delay():
    import types

    from kvbridge_agent.nixl._loader import NixlModule

    seen = []

    def real_constructor(name, cfg):
        seen.append((name, cfg.pthrDelay))
        return object()

    bindings = types.SimpleNamespace(nixlAgent=real_constructor)

    class Api:
        nixlBind = bindings

        @staticmethod
        def nixl_agent_config(**kw):
            return kw

        @staticmethod
        def nixl_agent(name, conf):
            cfg = types.SimpleNamespace(pthrDelay=0)   # what the stock wrapper hard-codes
            bindings.nixlAgent(name, cfg)
            return object()

    fake = NixlModule(package="fake", api=Api, bindings=bindings)
    nx.NixlAgent("a", nixl=fake)
    nx.NixlAgent("b", nx.AgentConfig(progress_delay_us=250), nixl=fake)
    assert seen == [("a", 100), ("b", 250)]
    assert bindings.nixlAgent is real_constructor          # restored after construction


def test_plan_region_mapped_positional_rule_uses_token_positions():
    # P advertises pages [A, B, C, unused]; D holds three pages. Suffix alignment would
    # pair D with [B, C, unused]; with the token count the pairing is [A, B, C] (#57077).
    plan = _plan([0, 1], [8, 8])
    remote = _remote([0, 0], [8, 8])
    kw = {"local_block_size": 16, "local_ppl": 1, "remote": remote,
          "local_block_ids": [[5, 6, 7], [1, 2, 3]], "remote_block_ids": [[0, 1, 2, 3]]}
    suffix = plan_read_ids(plan, **kw)
    assert suffix.remote_ids.tolist() == [1, 2, 3, 9, 10, 11]
    positional = plan_read_ids(plan, **kw, num_computed_blocks=[0, 0], remote_num_tokens=48)
    assert positional.local_ids.tolist() == [5, 6, 7, 9, 10, 11]
    assert positional.remote_ids.tolist() == [0, 1, 2, 8, 9, 10]
