"""Agents and operator together on a real control plane: real agent processes (real NIXL,
real side channel) that publish their KVEndpoints with pod-bound ServiceAccount tokens,
preflight the peers the operator assigns, transfer, survive restarts and pod deletion."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge_operator.config import ENDPOINTS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

SEED = 11
LOCAL = [[1, 2, 3, 4], [10, 11]]
REMOTE = [[20, 21, 22, 23], [40, 63]]


@pytest.fixture
def pods(cluster, api: Api, ns: str) -> Iterator[list[SimPod]]:
    create_agent_rbac(cluster.api_client(), ns)
    api.create_transfer(ns)
    made: list[SimPod] = []
    yield made
    for p in made:
        p.close()


def start(pods: list[SimPod], cluster, ns: str, name: str, role: str, engine: str,
          **kw) -> SimPod:
    p = SimPod(cluster, ns, name, role=role, engine_id=engine, seed=SEED, **kw)
    pods.append(p)
    p.start()
    return p


def pull(d: SimPod, rid: str, **kw) -> dict:
    return d.call("pull", request_id=rid, remote_engine_id="P", local_block_ids=LOCAL,
                  remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=5.0, **kw)


def test_restart_prefill_new_epoch_rehandshake_no_stale_completion(cluster, api: Api, ns: str,
                                                                    pods) -> None:
    p = start(pods, cluster, ns, "p-0", "prefill", "P")
    d = start(pods, cluster, ns, "d-0", "decode", "D", preset="mixed")
    wait_for(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=60, what="preflight")
    api.wait_condition(ns, "Ready", "True", timeout=60)
    e1 = p.status()["epoch"]
    ep = api.endpoint(ns, "d-0")
    assert ep["metadata"]["ownerReferences"][0]["uid"] == d.uid
    assert [(h["peer"], h["epoch"], h["state"]) for h in ep["status"]["handshakes"]] == [
        ("p-0", e1, "Succeeded")]

    p.call("hold", request_ids=["r1"])
    first = pull(d, "r1")
    assert first["ok"] and first["verified"], first
    wait_for(lambda: "r1" in p.call("completions")["finished"], timeout=10, what="r1 done")

    p.restart()
    e2 = p.status()["epoch"]
    assert e2 > e1
    # Until the decode side has re-handshaken, a request against the old peer fails typed.
    early = pull(d, "r2", expected_epoch=e2)
    if not early["ok"]:
        assert early["cause"] in ("stale_peer", "remote_disconnect", "unknown_remote", "setup",
                                  "transfer"), early
    else:   # only possible once the decode side already loaded the new epoch
        assert d.status()["peers"] == {"p-0": e2}
    wait_for(lambda: d.status()["peers"] == {"p-0": e2} and handshakes_ok(p),
             timeout=60, what="re-handshake at the new epoch")
    p.call("hold", request_ids=["r3"])
    d.call("clear")
    third = pull(d, "r3", expected_epoch=e2)
    assert third["ok"] and third["verified"], third
    wait_for(lambda: "r3" in p.call("completions")["finished"], timeout=10, what="r3 done")
    assert api.endpoint(ns, "p-0")["spec"]["epoch"] == e2
    wait_for(lambda: [(h["peer"], h["epoch"], h["state"]) for h in
                      api.endpoint(ns, "d-0")["status"]["handshakes"]] == [
                          ("p-0", e2, "Succeeded")], timeout=30, what="reported at e2")


def test_deleting_decode_pod_collects_endpoint_and_replans(cluster, api: Api, ns: str,
                                                            pods) -> None:
    p = start(pods, cluster, ns, "p-0", "prefill", "P")
    d = start(pods, cluster, ns, "d-0", "decode", "D")
    wait_for(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=60, what="preflight")
    d.kill()
    d.delete_pod()
    wait_for(lambda: "d-0" not in api.endpoints(ns), timeout=60, what="endpoint GC")
    wait_for(lambda: not (api.endpoint(ns, "p-0").get("status") or {}).get("peers"),
             timeout=30, what="prefill re-planned without peers")
    wait_for(lambda: p.status()["peers"] == {}, timeout=30, what="prefill dropped the peer")
    st = (api.transfer(ns).get("status") or {})
    assert st.get("pairs", {}).get("total", 0) == 0
    # A successor decode pod pairs and handshakes again.
    d2 = start(pods, cluster, ns, "d-1", "decode", "D2")
    wait_for(lambda: handshakes_ok(d2) and handshakes_ok(p), timeout=60, what="new pair")
    p.call("hold", request_ids=["s1"])
    res = d2.call("pull", request_id="s1", remote_engine_id="P", local_block_ids=LOCAL,
                  remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=5.0)
    assert res["ok"] and res["verified"], res
    assert ENDPOINTS == "kvendpoints"


def test_incompatible_decode_is_refused_with_reason(cluster, api: Api, ns: str, pods) -> None:
    start(pods, cluster, ns, "p-0", "prefill", "P")
    start(pods, cluster, ns, "bad-0", "decode", "BAD", preset="bad-block")

    def refused() -> dict:
        st = api.endpoint(ns, "bad-0").get("status") or {}
        return st if st.get("state") == "Incompatible" else {}

    st = wait_for(refused, timeout=60, what="bad decode Incompatible")
    assert "block_len" in st["message"].replace("blockLen", "block_len"), st["message"]


def test_agent_cannot_write_with_admin_rights_it_does_not_have(cluster, api: Api, ns: str,
                                                               pods) -> None:
    """The pod-bound token can publish its endpoint but cannot touch pods or secrets."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvbridge_testkit.sim import pod_bound_token

    p = start(pods, cluster, ns, "p-0", "prefill", "P")
    token = pod_bound_token(cluster.kubectl, ns, "kvbridge-agent", p.name)
    core = client.CoreV1Api(cluster.api_client(cluster.kubeconfig_for_token(token, "probe")))
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_secret(ns)
    assert exc.value.status == 403
