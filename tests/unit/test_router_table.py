"""The router's routing table (pure): a pair carries requests only while the operator pairs
it and the decode reports a succeeded handshake at the prefill's current epoch; and the
balancer's least-outstanding choice among those pairs."""

from __future__ import annotations

from typing import Any

from kvbridge_router.balance import Balancer
from kvbridge_router.pod_state import PodState, pod_state
from kvbridge_router.table import routing_table

T = "kvt"
TRANSFER = {"metadata": {"name": T}, "spec": {}}


def ep(name: str, role: str, *, engine: str | None = None, epoch: int = 1, host: str = "",
       state: str = "Paired", peers: tuple[tuple[str, int], ...] = (),
       shakes: tuple[tuple[str, int, str], ...] = (), rank: int = 0, tp: int = 1,
       deleting: bool = False, serving_port: int = 0) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    doc = {
        "metadata": meta,
        "spec": {"transferName": T, "role": role, "engineId": engine or name, "epoch": epoch,
                 "podName": name, "tpRank": rank, "tpSize": tp,
                 "sideChannel": {"host": host or f"10.0.0.{abs(hash(name)) % 200}",
                                 "port": 5600}},
        "status": {"state": state, "peers": [{"name": n, "epoch": e} for n, e in peers],
                   "handshakes": [{"peer": n, "epoch": e, "state": s} for n, e, s in shakes]},
    }  # fmt: skip
    if serving_port:
        doc["spec"]["servingPort"] = serving_port
    return doc


def verified_decode(name: str, prefill: str = "p0", epoch: int = 1, **kw: Any
                    ) -> dict[str, Any]:  # fmt: skip
    return ep(name, "decode", peers=((prefill, epoch),),
              shakes=((prefill, epoch, "Succeeded"),), **kw)


def test_verified_pairs_only() -> None:
    table = routing_table(T, TRANSFER, [
        ep("p0", "prefill"), ep("p1", "prefill"),
        verified_decode("d0"),
        ep("d1", "decode", peers=(("p0", 1),)),                          # not preflighted
        ep("d2", "decode", peers=(("p0", 1),), shakes=(("p0", 1, "Failed"),)),
        verified_decode("d3", "p1"),
        ep("d4", "decode", state="Incompatible"),
    ])
    assert dict(table.pairs) == {"d0": ("p0",), "d3": ("p1",)}
    assert table.engines["d0"].host and not table.reason


def test_a_restarted_prefill_is_out_until_preflighted_at_its_new_epoch() -> None:
    old = [ep("p0", "prefill", epoch=2), verified_decode("d0", epoch=1)]
    table = routing_table(T, TRANSFER, old)
    assert not table.pairs and "no pair of KVTransfer kvt is verified" in table.reason
    new = [ep("p0", "prefill", epoch=2), verified_decode("d0", epoch=2)]
    assert dict(routing_table(T, TRANSFER, new).pairs) == {"d0": ("p0",)}


def test_gone_terminating_or_unpaired_endpoints_take_the_pair_out() -> None:
    for docs in ([verified_decode("d0")],                                   # prefill gone
                 [ep("p0", "prefill", deleting=True), verified_decode("d0")],
                 [ep("p0", "prefill", state="Stale"), verified_decode("d0")],
                 [ep("p0", "prefill"), verified_decode("d0", deleting=True)],
                 [ep("p0", "prefill"), verified_decode("d0", state="Unpaired")]):
        assert not routing_table(T, TRANSFER, docs).pairs, docs


def test_no_transfer_and_reasons() -> None:
    assert routing_table(T, None, [ep("p0", "prefill")]).reason == "KVTransfer kvt does not exist"
    assert "no decode" in routing_table(T, TRANSFER, [ep("p0", "prefill")]).reason
    assert "no prefill" in routing_table(T, TRANSFER, [verified_decode("d0")]).reason
    reason = routing_table(T, TRANSFER, [ep("p0", "prefill"),
                                         ep("d0", "decode", state="Pending")]).reason
    assert "is paired" in reason and "Pending" in reason
    other = verified_decode("d0")
    other["spec"]["transferName"] = "other"
    assert not routing_table(T, TRANSFER, [ep("p0", "prefill"), other]).pairs


def test_tensor_parallel_engines_need_every_rank_verified() -> None:
    prefill = [ep(f"p-{r}", "prefill", engine="P", rank=r, tp=2, host="10.0.0.9")
               for r in range(2)]
    decode_ok = [ep("d-0", "decode", engine="D", peers=(("p-0", 1), ("p-1", 1)),
                    shakes=(("p-0", 1, "Succeeded"), ("p-1", 1, "Succeeded")))]
    table = routing_table(T, TRANSFER, prefill + decode_ok)
    assert dict(table.pairs) == {"D": ("P",)} and table.engines["P"].host == "10.0.0.9"
    assert table.engines["P"].pods == ("p-0", "p-1")
    half = [ep("d-0", "decode", engine="D", peers=(("p-0", 1), ("p-1", 1)),
               shakes=(("p-0", 1, "Succeeded"),))]
    assert not routing_table(T, TRANSFER, prefill + half).pairs


def test_balancer_takes_the_least_loaded_decode_then_prefill_and_skips_failed_pairs() -> None:
    table = routing_table(T, TRANSFER, [
        ep("p0", "prefill"), ep("p1", "prefill"),
        ep("d0", "decode", peers=(("p0", 1), ("p1", 1)),
           shakes=(("p0", 1, "Succeeded"), ("p1", 1, "Succeeded"))),
        verified_decode("d1", "p1")])
    b = Balancer()
    b.outstanding.update({"d0": 1})
    pair = b.pick(table)
    assert pair is not None and (pair.decode.engine_id, pair.prefill.engine_id) == ("d1", "p1")
    b.outstanding.clear()
    b.outstanding.update({"d1": 2, "p0": 1})
    pair = b.pick(table)
    assert pair is not None and (pair.decode.engine_id, pair.prefill.engine_id) == ("d0", "p1")
    pair = b.pick(table, avoid={("d0", "p1")})            # p1 failed this request: p0 then
    assert pair is not None and (pair.decode.engine_id, pair.prefill.engine_id) == ("d0", "p0")
    assert b.pick(table, avoid={("d0", "p0"), ("d0", "p1"), ("d1", "p1")}) is None
    b.start(pair.decode)
    b.done(pair.decode)
    assert b.outstanding == {"d1": 2, "p0": 1}
    rotating = Balancer()   # idle engines share the first requests
    assert {rotating.pick(table).decode.engine_id for _ in range(4)} == {  # type: ignore[union-attr]
        "d0", "d1"}


def test_an_engine_is_reached_at_the_port_its_endpoint_states() -> None:
    table = routing_table(T, TRANSFER, [ep("p0", "prefill", host="127.0.0.1", serving_port=9101),
                                        verified_decode("d0", host="127.0.0.1")])
    assert (table.engines["p0"].host, table.engines["p0"].port) == ("127.0.0.1", 9101)
    assert table.engines["d0"].port == 0  # unstated: the router's --engine-port


def test_geometry_and_transport_per_pair_for_the_cost_estimate() -> None:
    def with_geometry(doc: dict[str, Any], block_len: int) -> dict[str, Any]:
        doc["spec"]["geometry"] = {"blockSize": 16, "numBlocks": 900,
                                   "physicalBlocksPerLogical": 2,
                                   "regions": [{"blockLen": block_len}, {"blockLen": block_len}]}
        return doc

    decode = [with_geometry(verified_decode("d0", engine="d", rank=r, tp=2), 100) for r in (0, 1)]
    decode[0]["status"]["handshakes"][0]["transport"] = "cma"
    decode[1]["status"]["handshakes"][0]["transport"] = "tcp"
    prefill = with_geometry(ep("p0", "prefill"), 100)
    prefill["spec"]["kvEventsPort"] = 5557
    table = routing_table(T, TRANSFER, [prefill, *decode])
    d = table.engines["d"]
    assert (d.block_size, d.num_blocks, d.block_bytes) == (32, 450, 2 * 2 * 2 * 100)
    assert d.kv_events_port == 0 and table.engines["p0"].kv_events_port == 5557
    assert table.transport("d", "p0") == "cma+tcp" and table.transport("d", "p9") == ""


def pod(name: str, *, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def pods(*docs: dict[str, Any]) -> dict[str, PodState]:
    return {d["metadata"]["name"]: pod_state(d) for d in docs}


def test_a_pair_takes_no_request_while_a_pod_is_terminating_not_ready_or_gone() -> None:
    docs = [ep("p0", "prefill"), ep("p1", "prefill"),
            ep("d0", "decode", peers=(("p0", 1), ("p1", 1)),
               shakes=(("p0", 1, "Succeeded"), ("p1", 1, "Succeeded"))),
            verified_decode("d1", "p1")]
    every = pods(pod("p0"), pod("p1"), pod("d0"), pod("d1"))
    assert dict(routing_table(T, TRANSFER, docs, every).pairs) == {"d0": ("p0", "p1"),
                                                                   "d1": ("p1",)}
    table = routing_table(T, TRANSFER, docs, {**every, **pods(pod("d0", deleting=True))})
    assert dict(table.pairs) == {"d1": ("p1",)}
    assert table.held == {"d0": "pod d0 terminating"}
    table = routing_table(T, TRANSFER, docs, {**every, **pods(pod("p1", ready=False))})
    assert dict(table.pairs) == {"d0": ("p0",)} and table.held == {"p1": "pod p1 not Ready"}
    gone = {k: v for k, v in every.items() if k != "p0"}
    assert dict(routing_table(T, TRANSFER, docs, gone).pairs) == {"d0": ("p1",), "d1": ("p1",)}
    # readiness back: the pair is back (a restarted container keeps its pod and endpoint)
    assert routing_table(T, TRANSFER, docs, every).held == {}


def test_every_pair_held_back_names_the_pods_and_no_pod_list_leaves_the_endpoints_to_decide(
) -> None:
    docs = [ep("p0", "prefill"), verified_decode("d0")]
    table = routing_table(T, TRANSFER, docs, pods(pod("p0", deleting=True), pod("d0")))
    assert not table.pairs
    assert table.reason == ("every verified pair of KVTransfer kvt has a pod that takes no "
                            "request now: p0: pod p0 terminating")
    assert dict(routing_table(T, TRANSFER, docs, None).pairs) == {"d0": ("p0",)}
    assert not routing_table(T, TRANSFER, docs, {}).pairs          # listed, none there


def test_pod_state_reads_readiness_and_the_deletion_timestamp() -> None:
    assert pod_state(pod("a")).unusable == ""
    assert pod_state(pod("a", ready=False)).unusable == "not Ready"
    assert pod_state(pod("a", deleting=True)).unusable == "terminating"
    assert pod_state({"metadata": {"name": "a"}}).unusable == "not Ready"  # no status yet
