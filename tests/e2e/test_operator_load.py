"""The operator under flapping epochs (agents restarting), at reduced scale: ~150 KVEndpoints
in two KVTransfers, a few of them publishing a new epoch over and over.

Counts, not times: the API server's own count of status writes against what the flaps can
require, planning rounds from the operator's metrics, its bookkeeping sizes before and after.
bench/bench_operator_load.py runs the same at 2,000 endpoints and reports times and memory.
"""

from __future__ import annotations

import random

import pytest
from kubernetes import client

from kvbridge_operator.config import ENDPOINTS, TRANSFERS
from kvbridge_testkit import load as L
from kvbridge_testkit.e2e import Api, http_get, wait_for
from kvbridge_testkit.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s

N_ENDPOINTS, N_TRANSFERS = 150, 2
HOT, FLAPS, RATE = 6, 120, 12.0  # 6 endpoints flap 20 times each, over ~10 s


def test_flapping_epochs_converge_with_bounded_writes_and_bookkeeping(
    cluster, api: Api, operator: OperatorProcess, ns: str
) -> None:
    transfers, endpoints = L.fleet(N_ENDPOINTS, N_TRANSFERS)
    for t in transfers:
        api.create(TRANSFERS, ns, t)
    for e in endpoints:
        api.create(ENDPOINTS, ns, e)
    epochs = {e["metadata"]["name"]: e["spec"]["epoch"] for e in endpoints}

    def wait_converged() -> None:
        problems: list[str] = []

        def converged() -> bool:
            problems[:] = L.convergence_problems(*L.list_objects(api.custom, ns), epochs)
            return not problems

        try:
            wait_for(converged, timeout=120, what="convergence")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {len(problems)} problems: {problems[:5]}") from None

    wait_converged()
    pairs_before = L.peer_names(L.list_objects(api.custom, ns)[1])

    def metrics() -> dict:
        return L.operator_samples(http_get(operator.metrics_url)[1])

    def tracked(samples: dict) -> dict[str, float]:
        return {k: L.operator_value(samples, "kvbridge_tracked_objects", kind=k)
                for k in ("planning_loops", "written_endpoint_statuses",
                          "written_transfer_statuses")}  # fmt: skip

    api_before, op_before = L.apiserver_requests(cluster.server, cluster.token), metrics()

    rng = random.Random(7)
    hot = [n for role in ("decode", "prefill") for n in rng.sample(
        sorted(e["metadata"]["name"] for e in endpoints if e["spec"]["role"] == role), HOT // 2)]
    flapper = L.Flapper(lambda: client.CustomObjectsApi(cluster.api_client()), ns, hot, epochs,
                        rate=RATE, count=FLAPS)  # fmt: skip
    flapper.run()
    wait_converged()
    transfers_now, endpoints_now = L.list_objects(api.custom, ns)
    api_after, op_after = L.apiserver_requests(cluster.server, cluster.token), metrics()

    def api_delta(resource: str) -> int:
        return L.status_patches(api_after, resource) - L.status_patches(api_before, resource)

    flaps = int(api_after[(ENDPOINTS, "", "PATCH")] - api_before[(ENDPOINTS, "", "PATCH")])
    rounds = int(L.operator_value(op_after, "kvbridge_reconciles_total")
                 - L.operator_value(op_before, "kvbridge_reconciles_total"))  # fmt: skip
    assert flaps == FLAPS == flapper.sent

    # A new epoch is not a reason to re-pair: every endpoint keeps the peers it had.
    peers = L.peer_names(endpoints_now)
    moved = {n: (sorted(pairs_before[n]), sorted(peers[n]))
             for n in peers if peers[n] != pairs_before[n]}  # fmt: skip
    assert not moved, f"{len(moved)} re-paired by epoch flaps: {list(moved.items())[:3]}"

    # Coalesced: an endpoint's status is written only when its own epoch or a peer's changed
    # (so never for the endpoints away from the flapping ones), and at most once per planning
    # round however many flaps that round saw: writes <= sum of min(rounds, changes).
    changes = {n: flapper.flapped[n] + sum(flapper.flapped[p] for p in peers[n]) for n in peers}
    bound = sum(min(rounds, c) for c in changes.values())
    endpoint_writes = api_delta(ENDPOINTS)
    assert endpoint_writes <= bound, (endpoint_writes, bound, rounds, flaps)
    # A KVTransfer status says nothing that depends on epochs: never rewritten.
    assert api_delta(TRANSFERS) == 0, api_delta(TRANSFERS)

    # The operator's bookkeeping follows the objects, not the flaps.
    assert tracked(op_after) == tracked(op_before), (tracked(op_before), tracked(op_after))
    assert tracked(op_after)["written_endpoint_statuses"] >= len(endpoints)
    assert L.convergence_problems(transfers_now, endpoints_now, epochs) == []
