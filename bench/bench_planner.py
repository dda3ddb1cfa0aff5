"""Planner scaling (pure) and convergence on the local control plane.

Section 1 (always): ``planner.plan`` on 1k and 10k endpoints (prefill engines with TP 2,
decode engines with TP 1, 1% of decode engines incompatible). Near-linear scaling shows as a
per-endpoint cost ratio close to 1.

Section 2 (when ``hack/test-stack.sh ensure`` has run; ``--no-cluster`` skips it): 200
prefill + 200 decode KVEndpoints created on a real kube-apiserver with the operator running
as ``kopf run``; time until every decode engine is paired, then until Ready after the fake
agents report their handshakes.

Prints one JSON line per measurement (bench/_common.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import best_time, emit
from kvbridge_operator import testing as T
from kvbridge_operator.planner import plan
from kvbridge_operator.spec import parse_endpoint, parse_transfer

REPO = Path(__file__).resolve().parents[1]


def topology(n_endpoints: int) -> tuple[Any, list[Any], list[dict]]:
    """Half the endpoints are prefill (TP 2 engines), half decode (TP 1); 1% bad decodes."""
    raw: list[dict] = []
    for i in range(n_endpoints // 4):
        raw += T.engine_manifests(f"p{i:05d}", "prefill", 2)
    n_decode = n_endpoints - len(raw)
    bad = T.regions(block_len=2048)
    for i in range(n_decode):
        geometry = {"regions": bad} if i % 100 == 99 else None
        raw.append(
            T.endpoint_manifest(
                f"d{i:05d}-0", role="decode", engine_id=f"d{i:05d}", geometry=geometry
            )
        )
    transfer = parse_transfer(T.transfer_manifest(prefill_tp=2, decode_tp=1))
    return transfer, [parse_endpoint(m) for m in raw], raw


def _interleaved(cases: dict[int, tuple[Any, list[Any]]], rounds: int = 7) -> dict[int, float]:
    """Best plan() time per size, sizes measured in alternation (the machine may be shared,
    so slow phases hit both sizes alike instead of skewing the ratio)."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for n, (transfer, eps) in cases.items():
            calls = max(1, 10_000 // n)
            start = time.perf_counter()
            for _ in range(calls):
                plan(transfer, eps)
            best[n] = min(best[n], (time.perf_counter() - start) / calls)
    return best


def bench_planner() -> None:
    sizes = (1_000, 10_000)
    built = {n: topology(n) for n in sizes}
    cases = {n: (t, eps) for n, (t, eps, _) in built.items()}
    times = _interleaved(cases)
    # Same, with the long-lived inputs out of the cyclic GC's reach (gc.freeze(), what an
    # operator holding its index in memory can do): separates GC cost from the algorithm.
    gc.collect()
    gc.freeze()
    frozen = _interleaved(cases)
    gc.unfreeze()
    for n in sizes:
        transfer, eps, raw = built[n]
        p = plan(transfer, eps)
        assert len(p.pairs) == (n // 2) - (n // 2) // 100, len(p.pairs)
        parse = best_time(lambda r=raw: [parse_endpoint(m) for m in r], min_time=0.3, repeat=3)
        emit(
            f"planner_plan_{n // 1000}k_endpoints",
            times[n],
            "s",
            f"parsing the same {n} KVEndpoints",
            times[n] / parse,
            lower_is_better=True,
            pairs=len(p.pairs),
            incompatible=len(p.problems),
        )
    per_1k, per_10k = times[1_000] / 1_000, times[10_000] / 10_000
    emit(
        "planner_per_endpoint_cost_10k",
        per_10k * 1e6,
        "us/endpoint",
        "per-endpoint cost at 1k endpoints (1.0 = perfectly linear)",
        per_10k / per_1k,
        lower_is_better=True,
        time_ratio_10k_over_1k=times[10_000] / times[1_000],
    )
    emit(
        "planner_per_endpoint_cost_10k_gc_frozen",
        frozen[10_000] / 10_000 * 1e6,
        "us/endpoint",
        "per-endpoint cost at 1k endpoints, inputs gc-frozen (1.0 = perfectly linear)",
        (frozen[10_000] / 10_000) / (frozen[1_000] / 1_000),
        lower_is_better=True,
    )


def bench_cluster() -> None:
    from kubernetes import client

    from kvbridge_testkit import cluster as kc
    from kvbridge_testkit.operator_process import OperatorProcess

    try:
        kc.Binaries.find()
    except kc.StackMissingError as exc:
        print(f"bench_planner: cluster section skipped: {exc}", file=sys.stderr)
        return
    n = 200
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-"))
    with kc.LocalCluster(workdir=work / "cluster") as cluster:
        cluster.kubectl("apply", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        cluster.kubectl("create", "namespace", "bench")
        settings = {
            "KVBRIDGE_LEADER_ELECTION": "false",
            "KVBRIDGE_METRICS_PORT": "0",
            "KVBRIDGE_WEBHOOK_PORT": "0",
            "KVBRIDGE_DEBOUNCE": "0.2",
        }
        op = OperatorProcess(cluster.kubeconfig, work, settings, {"liveness": kc.free_port()},
                             extra_args=["--standalone"], log_name="operator.log",
                             stop_timeout=30)  # fmt: skip
        try:
            op.start()
            _converge(cluster, client, n)
        finally:
            op.stop()


def _converge(cluster: Any, client: Any, n: int) -> None:
    api = client.CustomObjectsApi(cluster.api_client())
    g, v = "kvbridge.io", "v1alpha1"
    api.create_namespaced_custom_object(g, v, "bench", "kvtransfers", T.transfer_manifest())
    start = time.perf_counter()
    for i in range(n):
        for role in ("prefill", "decode"):
            body = T.endpoint_manifest(f"{role[0]}{i:04d}", role=role, engine_id=f"{role[0]}{i}")
            api.create_namespaced_custom_object(g, v, "bench", "kvendpoints", body)
    created = time.perf_counter()

    def status() -> dict:
        obj = api.get_namespaced_custom_object(g, v, "bench", "kvtransfers", "kvt")
        return obj.get("status") or {}

    def wait(pred: Any, what: str, timeout: float = 120) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred(status()):
                return time.perf_counter()
            time.sleep(0.05)
        raise TimeoutError(f"bench: {what} not reached; last status {status()}")

    paired = wait(lambda s: (s.get("pairs") or {}).get("total") == n, "all pairs")
    hs_start = time.perf_counter()
    items = api.list_namespaced_custom_object(g, v, "bench", "kvendpoints")["items"]
    for e in items:
        peers = (e.get("status") or {}).get("peers") or []
        if e["spec"]["role"] == "decode":
            api.patch_namespaced_custom_object_status(
                g,
                v,
                "bench",
                "kvendpoints",
                e["metadata"]["name"],
                {"status": {"handshakes": [T.handshake(p["name"], p["epoch"]) for p in peers]}},
            )
    hs_done = time.perf_counter()
    ready = wait(
        lambda s: any(
            c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions") or ()
        ),
        "Ready",
    )
    emit(
        "cluster_200p_200d_paired_after_last_create",
        paired - created,
        "s",
        f"creating the {2 * n} KVEndpoints through the API ({created - start:.1f} s)",
        (paired - created) / (created - start),
        lower_is_better=True,
        total_from_first_create_s=paired - start,
    )
    emit(
        "cluster_200p_200d_ready_after_last_handshake",
        ready - hs_done,
        "s",
        f"writing {n} decode handshake statuses ({hs_done - hs_start:.1f} s)",
        (ready - hs_done) / (hs_done - hs_start),
        lower_is_better=True,
        total_create_to_ready_s=ready - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-cluster", action="store_true", help="skip the control-plane part")
    args = parser.parse_args()
    bench_planner()
    if not args.no_cluster:
        bench_cluster()


if __name__ == "__main__":
    main()
