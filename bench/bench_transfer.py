"""Cross-process NIXL pull throughput: the agent's PullEngine against raw NIXL and memcpy.

A spawned producer process owns the source memory and one NIXL agent; this process is the
consumer. For each case the three contenders move the same bytes, interleaved rep by rep in
a new random order each rep (so none always follows the same neighbour), and the median of
the reps is reported:

- agent: ``PullEngine.start`` + ``wait`` (id planning, mem-type split, post, poll,
  completion notification) — with coalescing off and on where it matters;
- raw NIXL: one ``make_prepped_xfer`` over the very same prepared lists and descriptor ids,
  ``transfer``, poll, release (no planning, no notification); for the small-block cases also
  ``raw_notified``: the same READ carrying the completion notification the protocol requires
  (the agent's single READ carries it), so the agent's own overhead shows apart from it;
- memcpy: numpy copy of the same bytes between two buffers of this process.

Cases: one large region; a DeepSeek-like request (61 regions of 73,728-byte blocks, 128
blocks per region, half of them read) with scattered and with contiguous blocks; the same
as a mixed-memory request (consumer regions alternate DRAM/VRAM, CPU map) against the
unsplit request; a small request (2 scattered 4 KiB blocks in each of 61 regions, 0.5 MB),
where the agent's fixed per-request cost shows (its lines add the median
microseconds per request of both contenders and their difference, and the notified line the
notification's own cost, raw_notified - raw), and the same with 8 and
32 blocks (2 MB, 8 MB) between it and the large cases; the pod-to-pod pull of tests/node
(256 descriptors of 16 KiB, 4 MiB) over cma and over tcp (``UCX_TLS=tcp`` on both sides: the
transport UCX falls back to between pods), with the ratio of the two.
``KVB_BENCH_CASES=a,b`` runs only those cases. Each shape's cases run with only their own
producer process and consumer agents alive (idle NIXL agents' progress threads would
otherwise share the 2 cores with the contenders). Buffers are pre-faulted. Output: JSON lines
(bench/_common.py); higher ``ratio`` is better for every line.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from unittest import mock

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from _common import best_time, emit

REPS = int(os.environ.get("KVB_BENCH_REPS", "25"))
#: Comma-separated case names to run (default: all), e.g. ``KVB_BENCH_CASES=small_request``.
CASES = [c for c in os.environ.get("KVB_BENCH_CASES", "").split(",") if c]
GAP = 1 << 16   # bytes between regions, so no two regions are adjacent in memory


class Pool:
    """``n`` regions of ``blocks`` x ``block_len`` bytes carved out of one buffer."""

    def __init__(self, n: int, blocks: int, block_len: int, fill: int) -> None:
        self.n, self.blocks, self.block_len = n, blocks, block_len
        self.region_bytes = blocks * block_len
        self.buf = np.full(n * (self.region_bytes + GAP), fill, dtype=np.uint8)  # pre-faulted

    def region(self, r: int) -> np.ndarray:
        start = r * (self.region_bytes + GAP)
        return self.buf[start:start + self.region_bytes]

    def views(self, mem_types: list[str]):
        from kvbridge_agent.geometry import CacheView

        return [CacheView.from_range(
            f"model.layers.{r}.self_attn.attn", self.region(r).ctypes.data, self.region_bytes,
            group_id=0, num_blocks=self.blocks, mem_type=mem_types[r % len(mem_types)],
            block_len=self.block_len) for r in range(self.n)]


def _producer(conn, shapes) -> None:
    from kvbridge_agent.nixl import (
        CPU_TEST_MEM_TYPES,
        AgentConfig,
        EngineFacts,
        LocalEngine,
        NixlAgent,
    )

    keep = []
    descs = {}
    for key, (n, blocks, block_len) in shapes.items():
        pool = Pool(n, blocks, block_len, fill=7)
        pool.buf[::4096] = np.arange(pool.buf[::4096].size, dtype=np.uint64).astype(np.uint8)
        agent = NixlAgent(f"bench-p-{key}", AgentConfig(mem_types=CPU_TEST_MEM_TYPES))
        local = LocalEngine(agent, pool.views(["VRAM"]), EngineFacts(f"bench-p-{key}"))
        keep.append((pool, agent, local))
        descs[key] = local.describe()
    conn.send(descs)
    while True:
        msg = conn.recv()
        if msg[0] == "add":
            for _, agent, _ in keep:
                for meta in msg[1]:
                    agent.add_remote(meta)
            conn.send("ok")
        elif msg[0] == "drain":
            for _, agent, _ in keep:
                agent.get_notifs()
            conn.send("ok")
        else:
            for _, agent, _ in keep:
                agent.close()
            conn.send("bye")
            return


class Consumer:
    def __init__(self, key: str, pool: Pool, mem_types: list[str]) -> None:
        from kvbridge_agent.nixl import (
            CPU_TEST_MEM_TYPES,
            AgentConfig,
            EngineFacts,
            LocalEngine,
            NixlAgent,
            PullEngine,
        )

        self.pool = pool
        self.agent = NixlAgent(f"bench-d-{key}", AgentConfig(mem_types=CPU_TEST_MEM_TYPES))
        self.local = LocalEngine(self.agent, pool.views(mem_types), EngineFacts(f"bench-d-{key}"))
        self.engine = PullEngine(self.local, timeout_s=60.0)   # coalescing: set per pull
        self._n = 0

    def pull(self, engine_id: str, lids: list[int], rids: list[int], coalesce: bool = False
             ) -> float:
        from kvbridge_agent.nixl import PullRequest, TransferDone

        self.engine.coalesce = coalesce
        self._n += 1
        rid = f"r{self._n}"
        t = time.perf_counter()
        self.engine.start(PullRequest(rid, engine_id, [lids], [rids]))
        res = self.engine.wait(rid, 60.0)
        dt = time.perf_counter() - t
        assert isinstance(res, TransferDone), res
        return dt

    def raw(self, engine_id: str, lids: list[int], rids: list[int], notif: bytes = b""
            ) -> float:
        """One raw prepared NIXL READ over the engine's own lists and the same ids (with
        ``notif``: carrying a completion notification, as the agent's single READ does)."""
        from kvbridge_agent.nixl import plan_read_ids

        peer = self.engine.peers.any_rank(engine_id)
        ids = plan_read_ids(self.local.plan, local_block_size=16, local_ppl=1,
                            remote=peer.desc, local_block_ids=[lids], remote_block_ids=[rids])
        llist = self.local.lists(1).by_kind["VRAM"]
        rlist = next(iter(peer.lists.values()))["VRAM"]
        nixl = self.agent._agent
        lidx = ids.local_ids.astype(np.int32)
        ridx = ids.remote_ids.astype(np.int32)
        t = time.perf_counter()
        h = nixl.make_prepped_xfer("READ", llist.handle, lidx, rlist.handle, ridx, notif)
        state = nixl.transfer(h)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = nixl.check_xfer_state(h)
        h.release()
        dt = time.perf_counter() - t
        assert state == "DONE", state
        return dt


def memcpy_blocks(dst: Pool, src: Pool, lids: np.ndarray, rids: np.ndarray) -> float:
    t = time.perf_counter()
    contiguous = bool((np.diff(lids) == 1).all() and (np.diff(rids) == 1).all())
    for r in range(dst.n):
        d = dst.region(r).reshape(dst.blocks, dst.block_len)
        s = src.region(r).reshape(src.blocks, src.block_len)
        if contiguous:
            d[lids[0]:lids[-1] + 1] = s[rids[0]:rids[-1] + 1]
        else:
            d[lids] = s[rids]
    return time.perf_counter() - t


def measure_case(name, shape, dims, eid, consumers, pools, lids, rids) -> None:
    """Interleave the contenders rep by rep; emit median rates and side-by-side ratios."""
    dst, src = pools
    n, _, block_len = dims
    nbytes = n * len(lids) * block_len
    lo, ro = lids.tolist(), rids.tolist()
    main = consumers[shape]
    contenders = {"agent": functools.partial(main.pull, eid, lo, ro),
                  "raw": functools.partial(main.raw, eid, lo, ro),
                  "memcpy": functools.partial(memcpy_blocks, dst, src, lids, rids)}
    if shape == "small":
        contenders["raw_notified"] = functools.partial(main.raw, eid, lo, ro, b"raw:1")
    if shape == "ds":
        contenders["agent_coalesced"] = functools.partial(main.pull, eid, lo, ro, coalesce=True)
        contenders["agent_mixed"] = functools.partial(consumers["ds-mixed"].pull, eid, lo, ro)
    for fn in contenders.values():      # warm-up: connections, lists, caches
        fn()
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    order = list(contenders)
    reps = REPS * 8 if shape == "small" else REPS     # microsecond requests: more reps
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        # A new order every rep: a contender runs slower after one that flushed the caches
        # (memcpy) than after another transfer, by more than the per-request costs measured
        # here; a fixed cycle would hand that penalty to one contender in every rep.
        shuffle(order)
        for key in order:
            runs[key].append(contenders[key]())
    gbps = {k: _median_rate(v, nbytes) for k, v in runs.items()}
    if shape in TRANSPORTS or shape == "pod":
        _POD_RATES[shape] = [gbps["agent"]]

    def ratio(a: str, b: str) -> float:
        """Median over reps of the paired speed ratio a/b (the two ran back to back)."""
        return statistics.median(tb / ta for ta, tb in zip(runs[a], runs[b], strict=True))

    extra = {"bytes": nbytes, "descriptors": n * len(lids), "reps": reps,
             "higher_is_better": True, "ratio_is": "median of per-rep paired ratios"}
    per_request = {}
    if shape == "small":
        agent_us = statistics.median(runs["agent"]) * 1e6
        raw_us = statistics.median(runs["raw"]) * 1e6
        per_request = {"agent_us": round(agent_us, 1), "raw_us": round(raw_us, 1),
                       "overhead_us": round(agent_us - raw_us, 1)}
    emit(f"transfer.{name}.agent_vs_raw_nixl", gbps["agent"], "GB/s",
         "raw NIXL prepared transfer, same descriptors", ratio("agent", "raw"),
         raw_gbps=round(gbps["raw"], 3), **per_request, **extra)
    if shape == "small":
        notified_us = statistics.median(runs["raw_notified"]) * 1e6
        emit(f"transfer.{name}.agent_vs_raw_nixl_notified", gbps["agent"], "GB/s",
             "raw NIXL prepared transfer, same descriptors, carrying the same completion "
             "notification the protocol requires", ratio("agent", "raw_notified"),
             raw_notified_gbps=round(gbps["raw_notified"], 3),
             agent_us=per_request["agent_us"], raw_notified_us=round(notified_us, 1),
             overhead_us=round(per_request["agent_us"] - notified_us, 1),
             notification_us=round(notified_us - per_request["raw_us"], 1), **extra)
    emit(f"transfer.{name}.agent_vs_memcpy", gbps["agent"], "GB/s",
         "numpy memcpy of the same bytes", ratio("agent", "memcpy"),
         memcpy_gbps=round(gbps["memcpy"], 3), **extra)
    if name == "small_request":
        plan_cost(name, main, eid, lo, ro)
    if shape != "ds":
        return
    emit(f"transfer.{name}.coalesced_vs_memcpy", gbps["agent_coalesced"], "GB/s",
         "numpy memcpy of the same bytes", ratio("agent_coalesced", "memcpy"), **extra)
    emit(f"transfer.{name}.coalesced_vs_uncoalesced", gbps["agent_coalesced"], "GB/s",
         "agent pull without coalescing", ratio("agent_coalesced", "agent"), **extra)
    emit(f"transfer.{name}.mixed_split_vs_unsplit", gbps["agent_mixed"], "GB/s",
         "the same request on a single-memory-type consumer (one transfer)",
         ratio("agent_mixed", "agent"), parts=2, **extra)


def plan_cost(name: str, c: Consumer, eid: str, lids: list[int], rids: list[int]) -> None:
    """Id planning of one request with the engines' cached DescIdLayouts (what the pull
    does) against building the layouts per call (what it did before caching them)."""
    from kvbridge_agent.nixl import plan_read_ids

    peer = c.engine.peers.any_rank(eid)
    kw = {"local_block_size": c.local.facts.block_size, "local_ppl": c.local.facts.ppl,
          "remote": peer.desc, "local_block_ids": [lids], "remote_block_ids": [rids]}
    cached = best_time(lambda: plan_read_ids(c.local.plan, **kw, local_layout=c.local.desc_layout,
                                             remote_layout=peer.layout), min_time=0.1)
    fresh = best_time(lambda: plan_read_ids(c.local.plan, **kw), min_time=0.1)
    emit(f"transfer.{name}.plan_cached_vs_uncached_layouts", round(cached * 1e6, 2), "us",
         "plan_read_ids building its DescIdLayouts per call (same ids, same run)",
         round(fresh / cached, 3), baseline_us=round(fresh * 1e6, 2), higher_is_better=True,
         ratio_is="speed-up: baseline time / value")


def _median_rate(times: list[float], nbytes: int) -> float:
    return nbytes / statistics.median(times) / 1e9


#: The consumers each shape's cases use: key -> memory types of their regions, in turn.
CONSUMERS = {
    "large": {"large": ["VRAM"]},
    "ds": {"ds": ["VRAM"], "ds-mixed": ["VRAM", "DRAM"]},
    "small": {"small": ["VRAM"]},
    "pod": {"pod": ["VRAM"]},
    "pod-tcp": {"pod-tcp": ["VRAM"]},
}
SHAPES = {
    "large": (1, 64, 4 << 20),                      # one 256 MiB region
    "ds": (61, 128, 73_728),                        # DeepSeek-like, 576 MiB
    "small": (61, 64, 4096),                        # small blocks: fixed costs
    "pod": (4, 64, 16_384),                         # the node test's pod-to-pod pull: 4 MiB
    "pod-tcp": (4, 64, 16_384),                     # ... over TCP, as between two pods
}
#: UCX_TLS of both processes per shape: UCX picks TCP between pods on one node (each has a
#: PID namespace of its own, so no cross-memory attach) and between nodes without RDMA.
TRANSPORTS = {"pod-tcp": "tcp"}
#: median GB/s of the agent per pod-pull shape, for the transport comparison
_POD_RATES: dict[str, list[float]] = {}


def cases() -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    half = 64
    return {
        "large_region": ("large", np.arange(64), np.arange(64)),
        "deepseek_scattered": ("ds", np.sort(rng.choice(128, half, replace=False)),
                               rng.choice(128, half, replace=False)),
        "deepseek_contiguous": ("ds", np.arange(half), np.arange(32, 32 + half)),
        "small_request": ("small", np.sort(rng.choice(64, 2, replace=False)),
                          rng.choice(64, 2, replace=False)),
        # between the small request and the large cases, so the per-request curve shows
        "request_8_blocks": ("small", np.sort(rng.choice(64, 8, replace=False)),
                             rng.choice(64, 8, replace=False)),
        "request_32_blocks": ("small", np.sort(rng.choice(64, 32, replace=False)),
                              rng.choice(64, 32, replace=False)),
        # the pod-to-pod pull of tests/node (every block of 4 regions: 256 descriptors,
        # 4 MiB), over cma and over tcp: where its time goes
        "pod_pull_cma": ("pod", np.arange(64), np.arange(64)),
        "pod_pull_tcp": ("pod-tcp", np.arange(64), np.arange(64)),
    }


def run_shape(shape: str, todo: dict[str, tuple[str, np.ndarray, np.ndarray]]) -> None:
    """One producer process and this shape's consumers, alive only while its cases run: every
    NIXL agent has a progress thread waking every 100 us, and on a 2-core machine idle agents
    of other shapes would steal time from whichever contender runs longer."""
    dims = SHAPES[shape]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, {shape: dims}), daemon=True)
    tls = TRANSPORTS.get(shape)
    with mock.patch.dict(os.environ, {"UCX_TLS": tls} if tls else {}):  # read as agents start
        proc.start()
        if not conn.poll(120):
            raise TimeoutError("producer did not start")
        desc = conn.recv()[shape]
        dst, src = Pool(*dims, fill=0), Pool(*dims, fill=3)   # src: the memcpy baseline's
        consumers = {key: Consumer(key, dst, mem_types)
                     for key, mem_types in CONSUMERS[shape].items()}
    try:
        for c in consumers.values():
            c.engine.add_remote(desc)
            transport = c.agent.transport_of(c.engine.peers.any_rank(desc.engine_id).agent_name)
            print(f"# {shape}: UCX reaches the producer over {transport}", file=sys.stderr)
        conn.send(("add", [c.agent.metadata() for c in consumers.values()]))
        assert conn.poll(60) and conn.recv() == "ok"
        for name, (_, lids, rids) in todo.items():
            measure_case(name, shape, dims, desc.engine_id, consumers, (dst, src), lids, rids)
            conn.send(("drain",))
            assert conn.poll(30) and conn.recv() == "ok"
    finally:
        for c in consumers.values():
            c.engine.close()
            c.agent.close()
        conn.send(("exit",))
        conn.poll(30)
        proc.join(30)


def emit_transport_ratio() -> None:
    """The pod pull over tcp against the same pull over cma (both through the agent)."""
    if {"pod", "pod-tcp"} <= set(_POD_RATES):
        cma, tcp = (statistics.median(_POD_RATES[k]) for k in ("pod", "pod-tcp"))
        emit("transfer.pod_pull.tcp_vs_cma", tcp, "GB/s",
             "the same pull through the agent over cma (processes sharing a PID namespace)",
             round(tcp / cma, 3), cma_gbps=round(cma, 3), higher_is_better=True,
             ratio_is="ratio of the two medians, measured one after the other in this run")


def main() -> None:
    t_start = time.monotonic()
    known = cases()
    unknown = set(CASES) - set(known)
    if unknown:
        raise SystemExit(f"KVB_BENCH_CASES: unknown {sorted(unknown)}; known: {sorted(known)}")
    for shape in SHAPES:
        todo = {name: case for name, case in known.items()
                if case[0] == shape and (not CASES or name in CASES)}
        if todo:
            run_shape(shape, todo)
    emit_transport_ratio()
    print(f"# bench_transfer took {time.monotonic() - t_start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
