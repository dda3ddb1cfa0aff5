"""Push mode end to end (spec §5): the operator pairs push-mode engines, the prefill agent
preflights its decode peer (it writes into the decode's memory), then WRITEs a request's
blocks; the decode agent learns of completion from the notification that came with them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

SEED = 31
PREFILL_IDS = [[1, 2, 3, 4], [10, 11]]
DECODE_IDS = [[20, 5, 22, 60], [40, 63]]


@pytest.fixture
def pods(cluster, api: Api, ns: str) -> Iterator[list[SimPod]]:
    create_agent_rbac(cluster.api_client(), ns)
    api.create_transfer(ns, mode="push")
    made: list[SimPod] = []
    yield made
    for p in made:
        p.close()


def test_push_mode_pair_preflights_and_writes_byte_exact(cluster, api: Api, ns: str,
                                                         pods: list[SimPod]) -> None:
    p = SimPod(cluster, ns, "p-0", role="prefill", engine_id="P", seed=SEED,
               extra_args=["--mode", "push"])
    d = SimPod(cluster, ns, "d-0", role="decode", engine_id="D", extra_args=["--mode", "push"])
    pods += [p, d]
    p.start()
    d.start()
    wait_for(lambda: handshakes_ok(p) and handshakes_ok(d), timeout=60, what="preflight")
    api.wait_condition(ns, "Ready", "True", timeout=60)
    assert api.endpoint(ns, "p-0")["spec"]["mode"] == "push"

    d.call("expect", request_id="w1", local_block_ids=DECODE_IDS)
    res = p.call("push", request_id="w1", remote_engine_id="D", local_block_ids=PREFILL_IDS,
                 remote_block_ids=DECODE_IDS, expected_epoch=d.ready["epoch"], timeout_s=10.0)
    assert res["ok"], res
    got = d.call("wait_received", request_id="w1", timeout_s=10.0)
    assert got["ok"], got
    assert d.call("verify", seed=SEED, local_block_ids=DECODE_IDS,
                  remote_block_ids=PREFILL_IDS)["verified"]
    assert d.call("completions") == {"finished": ["w1"], "expired": []}
    # A request nobody writes is not reported.
    d.call("expect", request_id="w2", local_block_ids=[[0], [0]], lease_s=30)
    assert d.call("wait_received", request_id="w2", timeout_s=0.5)["cause"] == "timeout"
    assert p.call("completions") == {"finished": [], "expired": []}
    wait_for(lambda: [h["state"] for h in
                      (api.endpoint(ns, "p-0").get("status") or {}).get("handshakes", [])]
             == ["Succeeded"], timeout=30, what="prefill reports its preflight")
