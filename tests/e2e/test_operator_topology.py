"""The operator on a real control plane: readiness, incompatibility, GC, restarts, scaling."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s


def _peers(api: Api, ns: str, name: str) -> list[tuple[str, int]]:
    status = api.endpoint(ns, name).get("status") or {}
    return [(p["name"], p["epoch"]) for p in status.get("peers") or []]


def _ready_topology(api: Api, ns: str, *, prefill: int = 2, decode: int = 2) -> None:
    api.create_transfer(ns, prefill_tp=2, decode_tp=1)
    for i in range(prefill):
        api.start_engine(ns, f"p{i}", "prefill", tp_size=2)
    for i in range(decode):
        api.start_engine(ns, f"d{i}", "decode", tp_size=1)
    api.wait_condition(ns, "Paired", "True")
    wait_for(lambda: api.report_handshakes(ns) >= 0 and
             api.condition(ns, "Ready").get("status") == "True",
             what="Ready after handshakes")  # fmt: skip


def test_valid_topology_becomes_ready(api: Api, ns: str, cluster) -> None:
    api.create_transfer(ns, prefill_tp=2, decode_tp=1)
    api.start_engine(ns, "p0", "prefill", tp_size=2)
    api.start_engine(ns, "d0", "decode", tp_size=1)
    api.start_engine(ns, "d1", "decode", tp_size=1)

    wait_for(
        lambda: (
            "2 decode engine(s) paired with 1 prefill engine(s)"
            in api.condition(ns, "Paired").get("message", "")
        ),
        what="both decodes paired",
    )
    hs = api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakesPending")
    assert "d0-0" in hs["message"]
    assert api.condition(ns, "Ready")["status"] == "False"
    # spec §1.9: a TP-1 decode rank handshakes with both ranks of the TP-2 prefill engine.
    assert sorted(n for n, _ in _peers(api, ns, "d0-0")) == ["p0-0", "p0-1"]
    p0 = api.endpoint(ns, "p0-0")["status"]
    assert p0["state"] == "Paired" and {p["name"] for p in p0["peers"]} == {"d0-0", "d1-0"}

    api.report_handshakes(ns)  # the decode agents' preflight succeeded
    ready = api.wait_condition(ns, "Ready", "True", reason="AllPairsVerified")
    assert ready["observedGeneration"] == api.transfer(ns)["metadata"]["generation"]
    status = api.transfer(ns)["status"]
    assert status["pairs"]["total"] == status["pairs"]["verified"] == 2
    assert status["decode"]["engines"] == 2 and status["prefill"]["engines"] == 1
    assert api.condition(ns, "Degraded")["status"] == "False"

    table = cluster.kubectl("get", "kvt", "-n", ns).stdout
    assert table.split("\n")[0].split()[:7] == [
        "NAME", "READY", "PREFILL", "DECODE", "PAIRS", "VERIFIED", "DEGRADED"
    ]  # fmt: skip
    assert table.split("\n")[1].split()[:7] == ["kvt", "True", "1", "2", "2", "2", "False"]
    events = wait_for(
        lambda: [e for e in api.core.list_namespaced_event(ns).items if e.reason ==
                 "AllPairsVerified"], what="a Ready event")  # fmt: skip
    assert events[0].type == "Normal" and events[0].involved_object.kind == "KVTransfer"
    assert "kvendpoint" in cluster.kubectl("get", "kvbridge", "-n", ns, "-o", "name").stdout


def test_incompatible_decode_is_never_paired(api: Api, ns: str) -> None:
    _ready_topology(api, ns, prefill=1, decode=1)
    api.start_engine(ns, "dbad", "decode", geometry={"regions": manifests.regions(block_len=2048)})

    geo = api.wait_condition(ns, "GeometryCompatible", "False", reason="IncompatibleEndpoints")
    assert "dbad-0" in geo["message"]
    assert "spec.geometry.regions[0].blockLen" in geo["message"]
    bad = api.endpoint(ns, "dbad-0")["status"]
    assert bad["state"] == "Incompatible" and bad["peers"] == []
    assert bad["message"].startswith("spec.geometry.regions[0].blockLen")
    assert api.condition(ns, "Degraded")["status"] == "True"
    assert api.condition(ns, "Ready")["status"] == "True"  # the compatible pair still works
    problems = api.transfer(ns)["status"]["incompatible"]
    assert problems[0]["endpoint"] == "dbad-0" and problems[0]["rule"] == "block_lens"

    api.start_engine(ns, "p9", "prefill", tp_size=2)  # a re-plan with more prefill capacity
    wait_for(lambda: api.transfer(ns)["status"]["prefill"]["engines"] == 2, what="2 prefill")
    assert api.endpoint(ns, "dbad-0")["status"]["peers"] == []


def test_pod_deletion_garbage_collects_endpoint_and_replans(api: Api, ns: str) -> None:
    _ready_topology(api, ns, prefill=2, decode=2)
    pairs = {p["decodeEngine"]: p["prefillEngine"]
             for p in api.transfer(ns)["status"]["pairs"]["items"]}  # fmt: skip
    assert sorted(pairs.values()) == ["p0", "p1"]  # balanced
    api.delete_pods(ns, ["p1-0", "p1-1"])

    wait_for(lambda: not {"p1-0", "p1-1"} & set(api.endpoints(ns)), what="endpoints GC'd")
    wait_for(lambda: {p["prefillEngine"] for p in
                      api.transfer(ns)["status"]["pairs"]["items"]} == {"p0"},
             what="re-paired onto p0")  # fmt: skip
    moved = next(d for d, p in pairs.items() if p == "p1")
    assert sorted(n for n, _ in _peers(api, ns, f"{moved}-0")) == ["p0-0", "p0-1"]
    api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakesPending")
    api.report_handshakes(ns)
    api.wait_condition(ns, "Ready", "True")


def test_agent_restart_new_epoch_updates_peers(api: Api, ns: str) -> None:
    _ready_topology(api, ns, prefill=1, decode=2)
    assert ("p0-1", 1) in _peers(api, ns, "d0-0")
    api.patch(ENDPOINTS, ns, "p0-1", {"spec": {"epoch": 2}})  # the prefill agent restarted

    wait_for(lambda: ("p0-1", 2) in _peers(api, ns, "d0-0"), what="peer epoch 2 on d0-0")
    assert ("p0-1", 2) in _peers(api, ns, "d1-0")
    hs = api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakesPending")
    assert "d0-0" in hs["message"] and "d1-0" in hs["message"]
    assert api.endpoint(ns, "p0-1")["status"]["observedEpoch"] == 2
    api.report_handshakes(ns)
    api.wait_condition(ns, "Ready", "True")


def test_scale_decode_out_and_in(api: Api, ns: str) -> None:
    _ready_topology(api, ns, prefill=2, decode=1)
    for i in range(1, 4):
        api.start_engine(ns, f"d{i}", "decode")
    wait_for(lambda: api.transfer(ns)["status"]["pairs"]["total"] == 4, what="4 pairs")
    loads = [p["prefillEngine"] for p in api.transfer(ns)["status"]["pairs"]["items"]]
    assert sorted(loads) == ["p0", "p0", "p1", "p1"]
    api.report_handshakes(ns)
    api.wait_condition(ns, "Ready", "True")

    api.delete_pods(ns, ["d1-0", "d2-0", "d3-0"])
    wait_for(lambda: api.transfer(ns)["status"]["decode"]["endpoints"] == 1, what="scaled in")
    status = api.transfer(ns)["status"]
    assert status["pairs"]["total"] == 1 and status["decode"]["engines"] == 1
    assert api.condition(ns, "Ready")["status"] == "True"


def test_operator_restart_changes_nothing(api: Api, ns: str, operator: OperatorProcess) -> None:
    _ready_topology(api, ns, prefill=2, decode=3)
    api.start_engine(ns, "dbad", "decode", geometry={"blockSize": 7})
    api.wait_condition(ns, "GeometryCompatible", "False")

    def snapshot() -> dict[str, tuple[str, object]]:
        objs = {"kvt": api.transfer(ns), **api.endpoints(ns)}
        return {k: (o["metadata"]["resourceVersion"], o.get("status")) for k, o in objs.items()}

    before = wait_for(lambda: _settled(snapshot), what="a settled status")
    operator.stop()
    operator.start()
    wait_for(lambda: operator.metric("kvbridge_reconciles_total") >= 1, what="a re-plan")
    after = snapshot()
    assert after == before  # same resourceVersions: not a single write
    assert "Traceback" not in operator.log()


def _settled(snapshot):  # two equal snapshots 1 s apart
    import time

    first = snapshot()
    time.sleep(1.0)
    return first if snapshot() == first else None


def test_topology_aware_pairing_prefers_same_zone(api: Api, ns: str) -> None:
    api.create_transfer(ns, pairing={"policy": "TopologyAware",
                                     "topologyKey": "topology.kubernetes.io/zone"})  # fmt: skip
    api.start_engine(ns, "pa", "prefill", node="node-a")
    api.start_engine(ns, "pb", "prefill", node="node-b")
    for i in range(2):
        api.start_engine(ns, f"da{i}", "decode", node="node-a")
    api.start_engine(ns, "db0", "decode", node="node-b")
    wait_for(lambda: api.transfer(ns)["status"]["pairs"]["total"] == 3, what="3 pairs")
    pairs = {p["decodeEngine"]: p["prefillEngine"]
             for p in api.transfer(ns)["status"]["pairs"]["items"]}  # fmt: skip
    assert pairs == {"da0": "pa", "da1": "pa", "db0": "pb"}


ZONE = "topology.kubernetes.io/zone"


@pytest.fixture
def node_c(cluster) -> Iterator[str]:
    """A third node, zone-b, served by its own fake kubelet; deleted afterwards."""
    from kvbridge_testkit import cluster as kc

    name = f"node-c-{uuid.uuid4().hex[:5]}"
    with kc.FakeKubelet(cluster.api_client(), {name: {ZONE: "zone-b"}}):
        yield name
    cluster.kubectl("delete", "node", name, "--wait=false", check=False)


def test_topology_aware_pairing_follows_node_label_changes(api: Api, ns: str,
                                                           node_c: str) -> None:  # fmt: skip
    def pairs() -> dict[str, str]:
        items = api.transfer(ns)["status"]["pairs"]["items"]
        return {p["decodeEngine"]: p["prefillEngine"] for p in items}

    api.create_transfer(ns, pairing={"policy": "TopologyAware", "topologyKey": ZONE})
    api.start_engine(ns, "pa", "prefill", node="node-a")  # zone-a
    api.start_engine(ns, "pb", "prefill", node="node-b")  # zone-b
    api.start_engine(ns, "dc", "decode", node=node_c)
    wait_for(lambda: pairs() == {"dc": "pb"}, what="dc paired in zone-b")
    time.sleep(1.0)  # status echoes settle: from here only the node event can wake a re-plan

    # The node moves to zone-a: no pod changes, only the node's label.
    api.core.patch_node(node_c, {"metadata": {"labels": {ZONE: "zone-a"}}})
    wait_for(lambda: pairs() == {"dc": "pa"}, what="dc re-paired in zone-a")
    assert [p["name"] for p in api.endpoint(ns, "dc-0")["status"]["peers"]] == ["pa-0"]
    assert api.transfer(ns)["status"]["pairs"]["total"] == 1

    api.core.patch_node(node_c, {"metadata": {"labels": {ZONE: "zone-b"}}})
    wait_for(lambda: pairs() == {"dc": "pb"}, what="dc back in zone-b")
    assert [p["name"] for p in api.endpoint(ns, "dc-0")["status"]["peers"]] == ["pb-0"]


def _set_ready(api: Api, node: str, ready: bool) -> None:
    """What a kubelet posts (or the node controller, once the kubelet went silent)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {"type": "Ready", "status": "True" if ready else "Unknown",
                 "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                 "message": "test", "lastHeartbeatTime": now, "lastTransitionTime": now}
    api.core.patch_node_status(node, {"status": {"conditions": [condition]}})


def test_a_lost_node_drops_its_pairs_names_them_and_they_reform_when_it_is_back(
        api: Api, ns: str, node_c: str) -> None:  # fmt: skip
    def pairs() -> set[tuple[str, str]]:
        items = api.transfer(ns)["status"]["pairs"]["items"]
        return {(p["decodeEngine"], p["prefillEngine"]) for p in items}

    api.create_transfer(ns, pairing={"policy": "TopologyAware", "topologyKey": ZONE})
    api.start_engine(ns, "pa", "prefill", node="node-a")  # zone-a
    api.start_engine(ns, "pc", "prefill", node=node_c)    # zone-b
    api.start_engine(ns, "da", "decode", node="node-a")
    api.start_engine(ns, "dc", "decode", node=node_c)
    wait_for(lambda: pairs() == {("da", "pa"), ("dc", "pc")}, what="a pair per zone")
    api.report_handshakes(ns)
    api.wait_condition(ns, "Ready", "True", timeout=30)

    _set_ready(api, node_c, False)
    degraded = api.wait_condition(ns, "Degraded", "True", reason="NodeNotReady", timeout=30)
    assert (f"2 endpoint(s) lost their pairs on node(s) not Ready ({node_c}): dc-0, pc-0"
            in degraded["message"])
    wait_for(lambda: pairs() == {("da", "pa")}, what="only the pair on the Ready node left")
    assert api.condition(ns, "Ready")["status"] == "True"  # what is left is verified
    for name in ("dc-0", "pc-0"):
        st = api.endpoint(ns, name)["status"]
        assert (st["state"], st["reason"], st.get("peers") or []) == (
            "Excluded", "NodeNotReady", [])
    assert [p["name"] for p in api.endpoint(ns, "pa-0")["status"]["peers"]] == ["da-0"]
    events = wait_for(lambda: [e for e in api.core.list_namespaced_event(ns).items
                               if e.reason == "NodeNotReady"], timeout=30,
                      what="a NodeNotReady event")  # fmt: skip
    assert events[0].type == "Warning"

    _set_ready(api, node_c, True)
    wait_for(lambda: pairs() == {("da", "pa"), ("dc", "pc")}, what="the lost pair re-formed")
    api.report_handshakes(ns)
    api.wait_condition(ns, "Degraded", "False", reason="AsExpected", timeout=30)
    api.wait_condition(ns, "Ready", "True", timeout=30)


def test_required_topology_never_pairs_across_zones(api: Api, ns: str) -> None:
    def pairs() -> set[tuple[str, str]]:
        items = api.transfer(ns)["status"]["pairs"]["items"]
        return {(p["decodeEngine"], p["prefillEngine"]) for p in items}

    api.create_transfer(ns, pairing={"policy": "TopologyAware", "topologyKey": ZONE,
                                     "topologyScope": "Required"})  # fmt: skip
    api.start_engine(ns, "pa", "prefill", node="node-a")  # zone-a
    api.start_engine(ns, "da", "decode", node="node-a")
    api.start_engine(ns, "db", "decode", node="node-b")   # zone-b: no prefill there yet
    wait_for(lambda: pairs() == {("da", "pa")}, what="only the zone-a pair")
    st = wait_for(lambda: (lambda s: s if s.get("reason") == "NoPrefillInTopology" else None)(
        api.endpoint(ns, "db-0").get("status") or {}), what="db-0 told why it is unpaired")
    assert st["state"] == "Unpaired" and f"{ZONE}=zone-b" in st["message"]
    api.start_engine(ns, "pb", "prefill", node="node-b")
    wait_for(lambda: pairs() == {("da", "pa"), ("db", "pb")}, what="db paired in its zone")
