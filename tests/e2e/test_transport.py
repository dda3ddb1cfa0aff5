"""Which UCX transport carries each pair's KV, on a real control plane with real agents:
every decode agent reports the transport UCX selected for its prefill peer in
status.handshakes, the KVTransfer lists them per pair, and a pair over a transport that
spec.transport.accepted leaves out makes the KVTransfer Degraded (TransportFallback) with a
Warning event naming the rank pair, until the transport is accepted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge_operator.config import TRANSFERS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

SEED = 23
LOCAL = [[1, 2, 3], [4]]
REMOTE = [[7, 8, 9], [30]]


@pytest.fixture
def pods(cluster, api: Api, ns: str) -> Iterator[dict[str, SimPod]]:
    create_agent_rbac(cluster.api_client(), ns)
    api.create_transfer(ns, transport={"accepted": ["cma"]})
    made = {
        "p": SimPod(cluster, ns, "p-0", role="prefill", engine_id="P", seed=SEED),
        "cma": SimPod(cluster, ns, "d-cma-0", role="decode", engine_id="DC", seed=SEED),
        # What a pod whose CMA is blocked gets from UCX (seccomp, a PID namespace of its own):
        # TCP, silently. Here the agent is told so, the rest is UCX's own choice.
        "tcp": SimPod(cluster, ns, "d-tcp-0", role="decode", engine_id="DT", seed=SEED,
                      env={"UCX_TLS": "tcp"}),
    }
    try:
        for pod in made.values():
            pod.start()
        yield made
    finally:
        for pod in made.values():
            pod.close()


def _transports(api: Api, ns: str, name: str) -> list[tuple[str, str, str]]:
    hs = (api.endpoint(ns, name).get("status") or {}).get("handshakes") or []
    return [(h["peer"], h.get("transport", ""), h.get("transportDetail", "")) for h in hs
            if h["state"] == "Succeeded"]


def test_pairs_report_their_transport_and_a_fallback_degrades_until_accepted(
        api: Api, ns: str, pods: dict[str, SimPod]) -> None:  # fmt: skip
    p, cma, tcp = pods["p"], pods["cma"], pods["tcp"]
    wait_for(lambda: handshakes_ok(cma) and handshakes_ok(tcp) and handshakes_ok(p, 2),
             timeout=90, what="preflight of both decodes")  # fmt: skip
    wait_for(lambda: _transports(api, ns, "d-cma-0") and _transports(api, ns, "d-tcp-0"),
             timeout=60, what="handshakes published")  # fmt: skip
    assert _transports(api, ns, "d-cma-0") == [("p-0", "cma", "cma/memory")]
    [(peer, name, detail)] = _transports(api, ns, "d-tcp-0")
    assert (peer, name) == ("p-0", "tcp") and "tcp/lo" in detail

    # Both pairs move the right bytes: a fallback is slow, not wrong.
    for rid, d in (("c1", cma), ("t1", tcp)):
        p.call("hold", request_ids=[rid])
        got = d.call("pull", request_id=rid, remote_engine_id="P", local_block_ids=LOCAL,
                     remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=10.0)
        assert got["ok"] and got["verified"], got

    degraded = api.wait_condition(ns, "Degraded", "True", reason="TransportFallback",
                                  timeout=60)
    assert "1 rank pair(s) use a transport outside spec.transport.accepted [cma]" in \
        degraded["message"]
    assert "d-tcp-0 <- p-0 over tcp" in degraded["message"]
    assert api.condition(ns, "Ready")["status"] == "True"
    pairs = {i["decodeEngine"]: i.get("transports") for i in
             api.transfer(ns)["status"]["pairs"]["items"]}
    assert pairs == {"DC": ["cma"], "DT": ["tcp"]}
    events = wait_for(lambda: [e for e in api.core.list_namespaced_event(ns).items
                               if e.reason == "TransportFallback"], timeout=30,
                      what="a TransportFallback event")  # fmt: skip
    assert events[0].type == "Warning" and "d-tcp-0 <- p-0 over tcp" in events[0].message

    api.patch(TRANSFERS, ns, "kvt", {"spec": {"transport": {"accepted": ["cma", "tcp"]}}})
    api.wait_condition(ns, "Degraded", "False", reason="AsExpected", timeout=60)
