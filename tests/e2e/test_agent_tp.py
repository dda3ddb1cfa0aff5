"""TP > 1 end to end: an MLA model with prefill TP=2 and decode TP=1 (spec §1.9, §4.2 step 7).

Real control plane, real operator, real agent processes (one simulated pod per TP rank). The
operator assigns peers per rank from its planner: the decode rank handshakes with both
prefill ranks (``handshake_target_ranks(0, 1, 2) == [0, 1]``), each prefill rank serves the
decode rank. A pull reads one replica (prefill rank 0) and notifies both prefill ranks, so
every prefill rank that holds the request frees it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

# The two prefill ranks hold different bytes (a real replica would be identical), so the
# check below also proves which rank was read.
SEEDS = (21, 22)
LOCAL = [[1, 2, 3, 4], [10, 11]]
REMOTE = [[20, 21, 22, 23], [40, 63]]
BLOCK_LEN = 16384


@pytest.fixture
def pods(cluster, api: Api, ns: str) -> Iterator[list[SimPod]]:
    create_agent_rbac(cluster.api_client(), ns)
    api.create_transfer(ns, prefill_tp=2, decode_tp=1)
    made: list[SimPod] = []
    yield made
    for p in made:
        p.close()


def test_mla_prefill_tp2_decode_tp1_reads_one_replica_and_notifies_both(
        cluster, api: Api, ns: str, pods: list[SimPod]) -> None:
    prefill = []
    for rank, seed in enumerate(SEEDS):
        p = SimPod(cluster, ns, f"p-{rank}", role="prefill", engine_id="P", seed=seed,
                   extra_args=["--tp-rank", str(rank), "--tp-size", "2"])
        pods.append(p)
        prefill.append(p)
    d = SimPod(cluster, ns, "d-0", role="decode", engine_id="D")
    pods.append(d)
    for pod in pods:
        pod.start()
    assert [p.ready["tp_rank"] for p in prefill] == [0, 1]

    wait_for(lambda: handshakes_ok(d, peers=2) and all(handshakes_ok(p) for p in prefill),
             timeout=60, what="preflight of every rank pair")
    # The operator's per-rank assignment, as the agents read it from their endpoints.
    d_peers = api.endpoint(ns, "d-0")["status"]["peers"]
    assert [(x["name"], x["engineId"], x["tpRank"], x["tpSize"]) for x in d_peers] == [
        ("p-0", "P", 0, 2), ("p-1", "P", 1, 2)]
    for p in prefill:
        peers = api.endpoint(ns, p.name)["status"]["peers"]
        assert [(x["name"], x["tpRank"], x["tpSize"]) for x in peers] == [("d-0", 0, 1)]
    assert d.status()["peers"] == {p.name: p.ready["epoch"] for p in prefill}
    api.wait_condition(ns, "Ready", "True", timeout=60)

    for p in prefill:
        p.call("hold", request_ids=["r1"])
    res = d.call("pull", request_id="r1", remote_engine_id="P", local_block_ids=LOCAL,
                 remote_block_ids=REMOTE, verify_seed=SEEDS[0], timeout_s=10.0)
    assert res["ok"] and res["verified"], res
    assert res["nbytes"] == (2 * len(LOCAL[0]) + 2 * len(LOCAL[1])) * BLOCK_LEN   # one replica
    assert not d.call("verify", seed=SEEDS[1], local_block_ids=LOCAL,
                      remote_block_ids=REMOTE)["verified"]
    for p in prefill:
        wait_for(lambda p=p: "r1" in p.call("completions")["finished"], timeout=10,
                 what=f"r1 completion at {p.name}")
