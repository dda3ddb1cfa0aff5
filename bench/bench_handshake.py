"""Handshake round-trip latency on loopback vs a bare ZMQ REQ/ROUTER echo of the same size.

Both servers run in one child process (a ROUTER each; kvbridge's SideChannelServer and a
minimal echo loop), the client in this process. Samples are taken in alternating blocks so
drift hits both sides alike. Prints JSON lines (bench convention): ``value`` is the handshake
latency, ``baseline`` the echo latency measured in the same run, ``ratio`` = handshake / echo
(lower is better; target <= 1.5).

- ``handshake_rtt_p50/p99``: ``SideChannelClient.fetch`` on a kept socket (request, reply,
  two-phase decode with hash check, clock-offset sample) vs REQ send + recv of the same bytes.
- ``handshake_oneshot_p50``: ``fetch_metadata`` with a fresh socket each time (connect
  included) vs a fresh REQ socket echo.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import zmq

from kvbridge_agent.protocol import (
    CompatibilityFactors,
    NixlAgentMetadata,
    compatibility_hash,
    encode_payload,
    encode_request,
    encode_timestamp,
    make_payload,
)
from kvbridge_agent.sidechannel import SideChannelClient, SideChannelServer, fetch_metadata

LOOPBACK = "127.0.0.1"
KEPT_SAMPLES = 4000
ONESHOT_SAMPLES = 400
BLOCK = 200
NUM_LAYERS = 61  # DeepSeek-V3 (spec §9.2)


def make_hash() -> str:
    return compatibility_hash(
        CompatibilityFactors(
            vllm_version="1.4.2",
            model="deepseek-ai/DeepSeek-V3",
            dtype="torch.bfloat16",
            num_kv_heads=1,
            head_size=576,
            num_hidden_layers=NUM_LAYERS,
            attn_backend_name="FLASHMLA",
        )
    )


def make_payload_bytes() -> bytes:
    r = NUM_LAYERS
    meta = NixlAgentMetadata(
        engine_id="prefill-0",
        agent_metadata=bytes(range(256)) * 8,
        kv_caches_base_addr=[0x7F0000000000 + i * (1 << 30) for i in range(r)],
        device_id=0,
        num_blocks=32768,
        block_lens=[73728] * r,
        block_strides=[73728] * r,
        kv_cache_layout="HND",
        block_size=64,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASHMLA",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[32768] * r,
        region_group_ids=[0] * r,
        region_names=[f"model.layers.{i}.self_attn.attn" for i in range(r)],
        region_mem_types=["VRAM"] * r,
    )
    return encode_payload(make_payload(meta, make_hash()))


def serve(payload: bytes, ports: mp.Queue, stop: mp.Event) -> None:
    ctx = zmq.Context()
    echo = ctx.socket(zmq.ROUTER)
    echo.setsockopt(zmq.LINGER, 0)
    echo_port = echo.bind_to_random_port(f"tcp://{LOOPBACK}")
    with SideChannelServer({(0, 0): payload}, host=LOOPBACK, port=0, poll_interval_s=0.1) as server:
        ports.put((server.port, echo_port))
        while not stop.is_set():
            if echo.poll(100):
                ident, delim, _req = echo.recv_multipart()
                echo.send_multipart([ident, delim, payload, encode_timestamp(time.perf_counter())])
    echo.close(0)
    ctx.term()


def pct(samples: list[float], q: float) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if q < 100 else max(samples)
    )


def main() -> None:
    payload = make_payload_bytes()
    h = make_hash()
    mpc = mp.get_context("spawn")
    ports, stop = mpc.Queue(), mpc.Event()
    child = mpc.Process(target=serve, args=(payload, ports, stop), daemon=True)
    child.start()
    hs_port, echo_port = ports.get(timeout=30)
    ctx = zmq.Context()
    request = encode_request(0, 0)
    hs_kept: list[float] = []
    echo_kept: list[float] = []
    with SideChannelClient(context=ctx) as client:
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://{LOOPBACK}:{echo_port}")
        for _ in range(200):  # warm up both paths
            client.fetch(LOOPBACK, hs_port, local_hash=h)
            req.send(request)
            req.recv_multipart()
        while len(hs_kept) < KEPT_SAMPLES:
            for _ in range(BLOCK):
                t = time.perf_counter()
                client.fetch(LOOPBACK, hs_port, local_hash=h)
                hs_kept.append(time.perf_counter() - t)
            for _ in range(BLOCK):
                t = time.perf_counter()
                req.send(request)
                frames = req.recv_multipart()
                echo_kept.append(time.perf_counter() - t)
                assert len(frames[0]) == len(payload)
        req.close(0)
    hs_once: list[float] = []
    echo_once: list[float] = []
    while len(hs_once) < ONESHOT_SAMPLES:
        for _ in range(BLOCK // 4):
            t = time.perf_counter()
            fetch_metadata(LOOPBACK, hs_port, local_hash=h)
            hs_once.append(time.perf_counter() - t)
        for _ in range(BLOCK // 4):
            t = time.perf_counter()
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{LOOPBACK}:{echo_port}")
            sock.send(request)
            sock.recv_multipart()
            sock.close(0)
            echo_once.append(time.perf_counter() - t)
    stop.set()
    child.join(10)
    ctx.term()
    extra = {
        "payload_bytes": len(payload),
        "regions": NUM_LAYERS,
        "lower_is_better": True,
        "transport": "tcp loopback",
    }
    rows = [
        ("handshake_rtt_p50", hs_kept, echo_kept, 50, "zmq_req_router_echo_p50"),
        ("handshake_rtt_p99", hs_kept, echo_kept, 99, "zmq_req_router_echo_p99"),
        ("handshake_oneshot_p50", hs_once, echo_once, 50, "zmq_fresh_req_echo_p50"),
    ]
    for name, ours, base, q, base_name in rows:
        value, baseline = pct(ours, q) * 1e6, pct(base, q) * 1e6
        print(
            json.dumps(
                {
                    "name": name,
                    "value": round(value, 2),
                    "unit": "us",
                    "baseline": base_name,
                    "baseline_value": round(baseline, 2),
                    "ratio": round(value / baseline, 3),
                    "samples": len(ours),
                    **extra,
                }
            )
        )


if __name__ == "__main__":
    main()
