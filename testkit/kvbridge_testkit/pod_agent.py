"""A simulated pod's agent process: owns real KV memory, runs a real AgentService (NIXL +
side channel) and publishes/follows its KVEndpoint as the pod's ServiceAccount.

Started as a script by the demo and the e2e tests (``kvbridge_testkit.sim``: one process per
simulated pod, possibly inside a network namespace) and as the agent image's entrypoint, where
it and bridge.py sit alone in /opt/kvbridge/app without kvbridge_testkit installed. Control is
JSON lines: commands on stdin, one reply line per command on stdout (logs go to stderr). The
first stdout line is ``{"event": "ready", ...}``.

Commands: ``status``; ``exit``; ``clear`` (zero the memory); ``verify`` (compare blocks byte
for byte against a producer's seeded pattern). Pull mode: ``pull`` (decode: read blocks, then
``verify`` them), ``hold`` / ``completions`` (prefill). Push mode: ``expect`` (decode: the
local blocks a request will be written into), ``push`` (prefill: WRITE them),
``wait_received`` (decode, then ``verify``) and ``completions`` (decode). ``bench_pull``
(decode) times the same READ through the agent and as a raw NIXL READ, rep by rep.

``--tp-rank`` / ``--tp-size`` make the process one TP rank of its engine (one pod per rank).

In a real pod (the agent image, ``hack/node-images.sh``) there is no stdin to drive: it runs
without ``--kubeconfig`` (the pod's ServiceAccount token, in-cluster), advertises ``$POD_IP``
and serves the same JSON lines on ``--control-port`` (one client at a time).

Memory presets (``--preset``):
- ``grouped``: 4 MLA regions in 2 transfer groups, all VRAM (CPU-test map: DRAM in NIXL);
- ``mixed``: the same regions, the last one a DRAM host pool (decode side of a mixed pull);
- ``bad-block``: like ``grouped`` with half the block length (an incompatible decode).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

# Run from a checkout (testkit/kvbridge_testkit/), the checkout's agent comes first; in the agent
# image (/opt/kvbridge/app/) there is none and the installed kvbridge serves.
_CHECKOUT_AGENT = Path(__file__).resolve().parents[2] / "agent"
if (_CHECKOUT_AGENT / "kvbridge_agent").is_dir() and str(_CHECKOUT_AGENT) not in sys.path:
    sys.path.insert(0, str(_CHECKOUT_AGENT))

import numpy as np  # noqa: E402

NUM_BLOCKS = 64
BLOCK_LEN = 16384
REGIONS = [("model.layers.0.self_attn.attn", 0), ("model.layers.1.self_attn.attn", 0),
           ("model.layers.2.self_attn.attn", 1), ("model.layers.3.self_attn.attn", 1)]
COMPAT = {
    "vllm_version": "0.11.0", "model": "deepseek-ai/DeepSeek-V2-Lite", "dtype": "torch.bfloat16",
    "num_kv_heads": 1, "head_size": 576, "num_hidden_layers": 4,
    "attn_backend_name": "FLASHMLA", "cache_dtype": "auto", "is_hma_enabled": True,
    "speculative_config": None, "transfer_mode": "pull", "nixl_connector_version": 11,
}


def block_len(preset: str) -> int:
    return BLOCK_LEN // 2 if preset == "bad-block" else BLOCK_LEN


def pattern(seed: int, region: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, region]).integers(0, 256, nbytes, dtype=np.uint8)


def build_views(preset: str, seed: int | None) -> tuple[list[np.ndarray], list[Any]]:
    from kvbridge_agent.geometry import CacheView

    blen = block_len(preset)
    bufs, views = [], []
    for i, (name, group) in enumerate(REGIONS):
        buf = pattern(seed, i, NUM_BLOCKS * blen) if seed is not None else np.zeros(
            NUM_BLOCKS * blen, np.uint8)
        mem = "DRAM" if preset == "mixed" and i == len(REGIONS) - 1 else "VRAM"
        bufs.append(buf)
        views.append(CacheView.from_range(name, buf.ctypes.data, buf.nbytes, group_id=group,
                                          num_blocks=NUM_BLOCKS, mem_type=mem,
                                          block_len=blen, is_mla=True))
    return bufs, views


class PodAgent:
    def __init__(self, args: argparse.Namespace) -> None:
        from kvbridge_agent.kube import EndpointPublisher, PodDuties, PodIdentity, api_client
        from kvbridge_agent.nixl import CPU_TEST_MEM_TYPES
        from kvbridge_agent.service import AgentService, AgentSettings, EngineInfo

        self.args = args
        seed = args.seed if args.role == "prefill" else None
        self.bufs, views = build_views(args.preset, seed)
        pod = PodIdentity.from_env()
        if args.api_uds:   # inside a network namespace: reach the apiserver via a unix socket
            from urllib.parse import urlparse

            import yaml
            try:   # a module of kvbridge_testkit when imported, a script beside bridge.py when run
                from .bridge import tcp_to_unix
            except ImportError:
                from bridge import tcp_to_unix  # type: ignore[no-redef]

            kc = yaml.safe_load(Path(args.kubeconfig).read_text())
            server = kc["clusters"][0]["cluster"]["server"]
            url = urlparse(server)
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
            self.bridge = tcp_to_unix(url.hostname or "127.0.0.1", url.port or 443,
                                      args.api_uds)
        self.api = api_client(args.kubeconfig)
        publisher = EndpointPublisher(self.api, pod, labels={"kvbridge.io/role": args.role,
                                                             "kvbridge.io/agent": "true"})
        epoch = publisher.next_epoch(int(time.time() * 1000))
        self.service = AgentService(
            views, EngineInfo(args.engine_id, args.role, tp_rank=args.tp_rank,
                              tp_size=args.tp_size, block_size=16, kv_cache_layout="HND",
                              attn_backend_name="FLASHMLA", is_mla=True, mode=args.mode),
            {**COMPAT, "transfer_mode": args.mode},
            AgentSettings(side_channel_host=args.host, side_channel_port=args.port,
                          mem_types=CPU_TEST_MEM_TYPES, epoch=epoch,
                          handshake_timeout_s=args.handshake_timeout,
                          transfer_timeout_s=args.transfer_timeout)).start()
        try:
            self.duties = PodDuties.start(
                self.service, metrics_port=args.metrics_port if args.metrics_port >= 0 else None,
                metrics_addr=args.metrics_addr, publisher=publisher, transfer=args.transfer,
                sync_interval_s=args.sync_interval)
        except BaseException:
            self.service.close()
            raise
        self.metrics_port = self.duties.metrics_port or 0

    def status(self) -> dict[str, Any]:
        return {"epoch": self.service.epoch, "agent": self.service.agent_name,
                "tp_rank": self.service.engine.tp_rank, "mode": self.service.engine.mode,
                "port": self.service.port, "metrics_port": self.metrics_port,
                "pid": os.getpid(),
                "peers": {n: r.epoch for n, r in self.service.peers().items()},
                "handshakes": [r.to_status() | {"reason": r.reason}
                               for r in self.service.reports()]}

    @staticmethod
    def result(res: Any) -> dict[str, Any]:
        return {"ok": res.ok, "nbytes": res.nbytes, "descs": res.descs, "parts": res.parts,
                "seconds": res.seconds, "gbps": res.throughput_gbps, "cause": res.cause,
                "message": res.message}

    def pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        local, remote = cmd["local_block_ids"], cmd["remote_block_ids"]
        res = self.service.pull(cmd["request_id"], cmd["remote_engine_id"], local, remote,
                                expected_epoch=cmd.get("expected_epoch"),
                                timeout_s=cmd.get("timeout_s"))
        out = self.result(res)
        if res.ok and cmd.get("verify_seed") is not None:
            out["verified"] = self.verify(int(cmd["verify_seed"]), local, remote)
        return out

    def push(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.result(self.service.push(
            cmd["request_id"], cmd["remote_engine_id"], cmd["local_block_ids"],
            cmd["remote_block_ids"], expected_epoch=cmd.get("expected_epoch"),
            timeout_s=cmd.get("timeout_s")))

    def raw_read(self, engine_id: str, local: list[list[int]], remote: list[list[int]],
                 notify: str = "") -> tuple[float, int]:  # fmt: skip
        """One raw prepared NIXL READ over the agent's own prepared lists and descriptor ids
        for these blocks (no planning or bookkeeping; with ``notify``, carrying the completion
        notification of that request id, as the agent's READ does): seconds and bytes."""
        engine = self.service.pull_engine
        route = engine._route(engine_id) if engine is not None else None
        ids = route.read_ids(local, remote) if route is not None else None
        if route is None or ids is None:
            raise ValueError(f"no single-READ route from this decode to {engine_id!r}")
        nixl = engine.agent._agent
        lids, rids = ids[0].astype(np.int32), ids[1].astype(np.int32)
        from kvbridge_agent.nixl import completion_message

        notif = completion_message(notify, route.local_consumers) if notify else b""
        t = time.perf_counter()
        handle = nixl.make_prepped_xfer("READ", route.local_list.handle, lids,
                                        route.remote_list.handle, rids, notif)
        state = nixl.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = nixl.check_xfer_state(handle)
        handle.release()
        seconds = time.perf_counter() - t
        if state != "DONE":
            raise RuntimeError(f"raw READ from {engine_id!r} ended {state}")
        return seconds, ids[2]

    def bench_pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The same blocks read through the agent (``pull``), by :meth:`raw_read` and by
        :meth:`raw_read` carrying the completion notification, interleaved rep by rep in a new
        random order, each timed around the call: what the agent adds over NIXL between these
        two pods, and what of it the notification (which the protocol requires) costs. The
        prefill must hold ``<request_id>-<rep>`` and ``<request_id>-<rep>-n`` for every rep."""
        local, remote = cmd["local_block_ids"], cmd["remote_block_ids"]
        engine_id, reps, rid = cmd["remote_engine_id"], int(cmd.get("reps", 15)), cmd["request_id"]
        times: dict[str, list[float]] = {"agent": [], "raw": [], "raw_notified": []}
        nbytes = 0
        for rep in range(reps):
            for who in random.sample(sorted(times), len(times)):
                t = time.perf_counter()
                if who == "agent":
                    res = self.service.pull(f"{rid}-{rep}", engine_id, local, remote,
                                            timeout_s=cmd.get("timeout_s"))  # fmt: skip
                    if not res.ok:
                        return {"ok": False, "cause": res.cause, "message": res.message}
                    times[who].append(time.perf_counter() - t)
                else:
                    notify = f"{rid}-{rep}-n" if who == "raw_notified" else ""
                    seconds, nbytes = self.raw_read(engine_id, local, remote, notify)
                    times[who].append(seconds)
        median = {who: statistics.median(ts) for who, ts in times.items()}
        out = {"ok": True, "reps": reps, "nbytes": nbytes,
               **{f"{who}_gbps": nbytes / m / 1e9 for who, m in median.items()},
               **{f"{who}_ms": m * 1e3 for who, m in median.items()},
               "ratio": median["raw"] / median["agent"]}  # fmt: skip
        if cmd.get("verify_seed") is not None:  # the raw READ moved the same bytes
            for b in self.bufs:
                b.fill(0)
            self.raw_read(engine_id, local, remote)
            out["verified"] = self.verify(int(cmd["verify_seed"]), local, remote)
        return out

    def verify(self, seed: int, local: list[list[int]], remote: list[list[int]]) -> bool:
        blen = block_len(self.args.preset)
        for i, (_, g) in enumerate(REGIONS):
            src = pattern(seed, i, NUM_BLOCKS * blen)
            for lb, rb in zip(local[g], remote[g], strict=True):
                if not np.array_equal(self.bufs[i][lb * blen:(lb + 1) * blen],
                                      src[rb * blen:(rb + 1) * blen]):
                    return False
        return True

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("cmd")
        if op == "status":
            return self.status()
        if op == "pull":
            return self.pull(cmd)
        if op == "bench_pull":
            return self.bench_pull(cmd)
        if op == "hold":
            self.service.hold(cmd["request_ids"], cmd.get("lease_s"))
            return {"ok": True}
        if op == "completions":
            return self.service.completions()
        if op == "push":
            return self.push(cmd)
        if op == "expect":
            self.service.expect(cmd["request_id"], cmd["local_block_ids"],
                                lease_s=cmd.get("lease_s"))
            return {"ok": True}
        if op == "wait_received":
            return self.result(self.service.wait_received(cmd["request_id"],
                                                          cmd.get("timeout_s")))
        if op == "verify":
            return {"verified": self.verify(int(cmd["seed"]), cmd["local_block_ids"],
                                            cmd["remote_block_ids"])}
        if op == "clear":
            for b in self.bufs:
                b.fill(0)
            return {"ok": True}
        raise ValueError(f"unknown command {op!r}")

    def close(self) -> None:
        self.duties.stop()
        self.service.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubeconfig", default=None,
                    help="default: $KUBECONFIG, else the pod's in-cluster ServiceAccount token")
    ap.add_argument("--transfer", default="kvt")
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--preset", choices=("grouped", "mixed", "bad-block"), default="grouped")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--metrics-port", type=int, default=-1,
                    help="serve the agent's Prometheus metrics on this port (0: any free one)")
    ap.add_argument("--metrics-addr", default="127.0.0.1",
                    help="address the metrics bind (0.0.0.0 in a pod, for the scraper)")
    ap.add_argument("--sync-interval", type=float, default=0.3)
    ap.add_argument("--handshake-timeout", type=float, default=3.0)
    ap.add_argument("--transfer-timeout", type=float, default=5.0)
    ap.add_argument("--api-uds", default="", help="reach the apiserver through this unix "
                    "socket (agents inside a network namespace)")
    ap.add_argument("--control-port", type=int, default=0,
                    help="serve the JSON-line commands on this TCP port instead of stdin")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {os.environ.get('POD_NAME', '?')} %(name)s "
                               "%(levelname)s %(message)s")
    agent = PodAgent(args)

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        if args.control_port:
            serve_tcp(agent, args.control_port)
        else:
            reply({"event": "ready", **agent.status()})
            serve_lines(agent, sys.stdin, reply)
    finally:
        agent.close()
    return 0


def serve_lines(agent: PodAgent, lines: Any, reply: Any) -> bool:
    """Answer each command line; True when told to exit. A bad command gets an error reply."""
    for line in lines:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("cmd") == "exit":
                reply({"ok": True})
                return True
            reply(agent.handle(cmd))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    return False


def serve_tcp(agent: PodAgent, port: int) -> None:
    """The control lines over TCP, one connection at a time, until an ``exit`` command."""
    import socket

    logging.getLogger("pod_agent").info("control on port %d, ready: %s", port, agent.status())
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as server:
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile("rw", encoding="utf-8") as stream:

                def reply(obj: dict[str, Any], stream: Any = stream) -> None:
                    stream.write(json.dumps(obj) + "\n")
                    stream.flush()

                try:
                    if serve_lines(agent, stream, reply):
                        return
                except OSError:
                    continue  # the client went away; wait for the next one


if __name__ == "__main__":
    sys.exit(main())
