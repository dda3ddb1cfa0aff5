"""Operator under load: many KVEndpoints whose epochs flap (agents restarting).

On its own local control plane (kvbridge_testkit.cluster), with the operator installed as in
production (least-privilege token, admission webhook on, production debounce unless
KVBRIDGE_DEBOUNCE is set): create KVB_LOAD_ENDPOINTS KVEndpoints (default 2000) in
KVB_LOAD_TRANSFERS KVTransfers (default 4; prefill/decode TP 2/1, 1/1, 1/2, 2/2), wait until
converged, then publish new epochs (``spec.epoch`` + 1 on random endpoints, as restarted
agents do) at KVB_LOAD_RATE per second (10) for KVB_LOAD_SECONDS (60), and wait until
converged again. "Converged" is checked against the truth
(kvbridge_testkit.load.convergence_problems: every observedEpoch equals the epoch last
published, every endpoint paired with peers listed at their current epochs, the KVTransfer
counts equal to the stored objects).

Reports the times to converge, the operator's memory (VmRSS before, sampled during, after;
VmHWM), its status writes as counted by the API server (``apiserver_request_total``) against
the flaps and against what writing on every event would cost, planning rounds, and the sizes
of its bookkeeping (``kvbridge_tracked_objects``) before and after. One JSON line each.
KVB_KEEP=1 keeps the work directory (cluster and operator logs).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from _common import emit
from kvbridge_operator.config import ENDPOINTS, GROUP, TRANSFERS, VERSION
from kvbridge_testkit import REPO
from kvbridge_testkit import cluster as kc
from kvbridge_testkit import load as L
from kvbridge_testkit.e2e import deploy_operator, http_get

NS = "load"


def _env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError as exc:
        raise SystemExit(f"{name}: expected a number, got {raw!r}") from exc
    if value <= 0:
        raise SystemExit(f"{name}: expected a number > 0, got {raw!r}")
    return value


def _wait_converged(custom: Any, epochs: dict[str, int], timeout: float
                    ) -> tuple[float, float, list[dict]]:  # fmt: skip
    """Seconds from the call until converged, the resolution of that figure, and the
    endpoints as read then. A LIST is a snapshot taken when it starts, so the time is the
    start of the first read that finds convergence; the previous read (or the call) did not."""
    start = previous = time.monotonic()
    problems = ["not read yet"]
    while previous - start < timeout:
        began = time.monotonic()
        transfers, endpoints = L.list_objects(custom, NS)
        problems = L.convergence_problems(transfers, endpoints, epochs)
        if not problems:
            return began - start, began - previous, endpoints
        previous = began
        time.sleep(0.1)
    raise SystemExit(f"not converged after {timeout:.0f} s: {len(problems)} problems, e.g. "
                     f"{problems[:5]}")  # fmt: skip


class _Sampler(threading.Thread):
    """VmRSS of a process every ``interval`` seconds until stopped; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak, self.samples = 0, 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak = max(self.peak, L.memory_kib(self.pid)["VmRSS"])
            self.samples += 1
            self.halt.wait(self.interval)


def main() -> None:
    n = int(_env("KVB_LOAD_ENDPOINTS", 2000))
    n_transfers = int(_env("KVB_LOAD_TRANSFERS", 4))
    rate, seconds = _env("KVB_LOAD_RATE", 10), _env("KVB_LOAD_SECONDS", 60)
    transfers, endpoints = L.fleet(n, n_transfers)
    try:
        kc.Binaries.find()
    except kc.StackMissingError as exc:
        print(f"bench_operator_load skipped: {exc}", file=sys.stderr)
        return
    work = Path(tempfile.mkdtemp(prefix="kvb-load-"))
    env = {"KVBRIDGE_DEBOUNCE": os.environ["KVBRIDGE_DEBOUNCE"]} if os.environ.get(
        "KVBRIDGE_DEBOUNCE") else {}  # fmt: skip
    try:
        with kc.LocalCluster(workdir=work / "cluster") as cluster:
            cluster.kubectl("apply", "-f", str(REPO / "crds"))
            cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
            (work / "operator").mkdir()
            op = deploy_operator(cluster, work / "operator", env)
            try:
                _run(cluster, op, transfers, endpoints, rate, seconds)
            finally:
                op.stop()
    finally:
        if os.environ.get("KVB_KEEP"):
            print(f"bench_operator_load: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(cluster: Any, op: Any, transfers: list[dict], endpoints: list[dict], rate: float,
         seconds: float) -> None:  # fmt: skip
    def make_api() -> Any:
        return client.CustomObjectsApi(cluster.api_client())

    custom = make_api()
    cluster.kubectl("create", "namespace", NS)
    pid = op.proc.pid

    def operator_metrics() -> dict:
        return L.operator_samples(http_get(op.metrics_url, timeout=30)[1])

    for t in transfers:
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, TRANSFERS, t)
    local = threading.local()

    def create(body: dict) -> None:
        if not hasattr(local, "api"):
            local.api = make_api()
        local.api.create_namespaced_custom_object(GROUP, VERSION, NS, ENDPOINTS, body)

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, endpoints))
    created = time.monotonic() - start
    epochs = {e["metadata"]["name"]: e["spec"]["epoch"] for e in endpoints}
    initial, _, converged = _wait_converged(custom, epochs, timeout=600)
    peers_before = L.peer_names(converged)
    time.sleep(2)  # let the echo of the last writes settle before the "before" figures
    rss_before = L.memory_kib(pid)["VmRSS"]
    api_before, op_before = L.apiserver_requests(cluster.server, cluster.token), operator_metrics()

    count = max(1, round(rate * seconds))
    flapper = L.Flapper(make_api, NS, sorted(epochs), epochs, rate=rate, count=count)
    sampler = _Sampler(pid)
    sampler.start()
    flapper.run()
    converge, resolution, converged = _wait_converged(custom, epochs, timeout=600)
    sampler.halt.set()
    sampler.join()
    time.sleep(2)
    rss_after, hwm = L.memory_kib(pid)["VmRSS"], L.memory_kib(pid)["VmHWM"]
    api_after, op_after = L.apiserver_requests(cluster.server, cluster.token), operator_metrics()

    def api_delta(resource: str, sub: str = "", verb: str = "PATCH") -> int:
        key = (resource, sub, verb)
        return int(api_after.get(key, 0) - api_before.get(key, 0))

    def op_delta(name: str, **labels: str) -> float:
        return L.operator_value(op_after, name, **labels) - L.operator_value(
            op_before, name, **labels)  # fmt: skip

    flaps = api_delta(ENDPOINTS)  # spec patches the API server served: the flaps
    ep_writes = L.status_patches(api_after, ENDPOINTS) - L.status_patches(api_before, ENDPOINTS)
    tr_writes = L.status_patches(api_after, TRANSFERS) - L.status_patches(api_before, TRANSFERS)
    rounds = int(op_delta("kvbridge_reconciles_total"))
    # Writing on every event would rewrite the flapped endpoint and every endpoint listing it.
    peers = L.peer_names(converged)
    per_event = sum(k * (1 + len(peers[name])) for name, k in flapper.flapped.items())
    repaired = sum(1 for name, p in peers.items() if p != peers_before.get(name))
    tracked = {
        kind: (L.operator_value(op_before, "kvbridge_tracked_objects", kind=kind),
               L.operator_value(op_after, "kvbridge_tracked_objects", kind=kind))
        for kind in ("planning_loops", "written_endpoint_statuses", "written_transfer_statuses",
                     "nodes")
    }  # fmt: skip
    scale = {"endpoints": len(endpoints), "transfers": len(transfers), "rate_per_s": rate,
             "seconds": seconds}  # fmt: skip
    emit(
        "operator_load_initial_converge_s", initial, "s",
        f"creating the {len(endpoints)} KVEndpoints through the API ({created:.1f} s)",
        initial / created, lower_is_better=True, **scale,
    )  # fmt: skip
    emit(
        "operator_load_converge_after_flapping_s", converge, "s",
        f"the initial convergence of the same fleet ({initial:.1f} s)",
        converge / max(initial, 1e-3), lower_is_better=True, resolution_s=round(resolution, 2),
        flapping_s=round(flapper.finished - flapper.started, 2),
        achieved_rate_per_s=round(flapper.achieved_rate, 2), **scale,
    )  # fmt: skip
    emit(
        "operator_load_endpoint_status_writes_per_flap", ep_writes / max(flaps, 1), "writes/flap",
        f"a write per event for the flapped endpoint and each endpoint listing it "
        f"({per_event / max(flaps, 1):.2f}/flap)",
        ep_writes / max(per_event, 1), lower_is_better=True, flaps=flaps,
        flaps_sent=flapper.sent, endpoint_status_writes=ep_writes,
        transfer_status_writes=tr_writes, per_event_writes=per_event, planning_rounds=rounds,
        repaired_endpoints=repaired,
        endpoint_writes_per_round=round(ep_writes / max(rounds, 1), 2),
        operator_counted_writes=int(op_delta("kvbridge_status_writes_total")), **scale,
    )  # fmt: skip
    emit(
        "operator_load_rss_peak_during_flapping_mib", sampler.peak / 1024, "MiB",
        f"RSS after the initial convergence ({rss_before / 1024:.1f} MiB)",
        sampler.peak / rss_before, lower_is_better=True, samples=sampler.samples,
        rss_before_mib=round(rss_before / 1024, 1), rss_after_mib=round(rss_after / 1024, 1),
        hwm_mib=round(hwm / 1024, 1), **scale,
    )  # fmt: skip
    emit(
        "operator_load_rss_after_mib", rss_after / 1024, "MiB",
        f"RSS after the initial convergence ({rss_before / 1024:.1f} MiB)",
        rss_after / rss_before, lower_is_better=True,
        tracked_before_after={k: [int(a), int(b)] for k, (a, b) in tracked.items()}, **scale,
    )  # fmt: skip


if __name__ == "__main__":
    main()
