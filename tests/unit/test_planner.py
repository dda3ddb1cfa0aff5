"""The planner is pure: KVTransfer + KVEndpoints in, pairing and verdicts out. No cluster."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, ClassVar

import pytest

from kvbridge_operator import status as st
from kvbridge_operator import testing as T
from kvbridge_operator.errors import SpecError
from kvbridge_operator.planner import EndpointState, PairState, Plan, endpoint_field, plan
from kvbridge_operator.spec import Endpoint, Transfer, parse_endpoint, parse_transfer


def transfer(**kw: Any) -> Transfer:
    return parse_transfer(T.transfer_manifest(**kw))


def engines(prefix: str, role: str, n: int, tp: int = 1, **kw: Any) -> list[Endpoint]:
    out = []
    for i in range(n):
        out += [parse_endpoint(m) for m in T.engine_manifests(f"{prefix}{i}", role, tp, **kw)]
    return out


def ep(name: str, role: str, engine: str, **kw: Any) -> Endpoint:
    return parse_endpoint(T.endpoint_manifest(name, role=role, engine_id=engine, **kw))


def write_back(p: Plan, eps: list[Endpoint]) -> list[Endpoint]:
    """What the cluster looks like after the operator wrote ``p``'s endpoint statuses."""
    verdicts = {v.name: v for v in p.endpoints}
    return [dataclasses.replace(e, status=st.endpoint_status(verdicts[e.name], e)) for e in eps]


def handshakes_done(p: Plan, eps: list[Endpoint], ok: bool = True,
                    transports: dict[str, str] | None = None) -> list[Endpoint]:  # fmt: skip
    """The decode agents report a handshake with every assigned peer (over the transport
    ``transports`` names for the decode endpoint, if any)."""
    out = []
    for e in eps:
        v = p.endpoint(e.name)
        if e.role == "decode" and v.peers:
            tl = (transports or {}).get(e.name, "")
            hs = tuple(parse_endpoint({**T.endpoint_manifest(e.name, role="decode",
                                                             engine_id="x"),
                                       "status": {"handshakes": [
                                           T.handshake(x.name, x.epoch, ok, "boom", tl)
                                           for x in v.peers]}}).handshakes)  # fmt: skip
            e = dataclasses.replace(e, handshakes=hs)
        out.append(e)
    return out


def prefill_reports(p: Plan, eps: list[Endpoint], ok: bool = True) -> list[Endpoint]:
    """The prefill agents report a handshake with every assigned decode peer (push mode)."""
    out = []
    for e in eps:
        v = p.endpoint(e.name)
        if e.role == "prefill" and v.peers:
            hs = tuple(T.handshake(x.name, x.epoch, ok, "refused by decode") for x in v.peers)
            e = dataclasses.replace(e, handshakes=tuple(
                parse_endpoint({**T.endpoint_manifest(e.name, role="prefill", engine_id="x"),
                                "status": {"handshakes": list(hs)}}).handshakes))
        out.append(e)
    return out


def cond(p: Plan, ctype: str) -> tuple[str, str]:
    c = next(c for c in p.conditions if c.type == ctype)
    return c.status, c.reason


class TestPairing:
    def test_balanced_pairs_every_decode_engine(self) -> None:
        eps = engines("p", "prefill", 2) + engines("d", "decode", 5)
        p = plan(transfer(), eps)
        loads = sorted(pair.prefill_engine for pair in p.pairs)
        assert loads == ["p0", "p0", "p0", "p1", "p1"]
        assert cond(p, "Paired") == ("True", "AllDecodeEnginesPaired")
        assert cond(p, "GeometryCompatible") == ("True", "AllCompatible")
        assert cond(p, "HandshakesVerified") == ("False", "HandshakesPending")
        assert cond(p, "Ready") == ("False", "HandshakesPending")
        assert p.decode.engines == 5 and p.prefill.engines == 2

    @pytest.mark.parametrize(("d_tp", "p_tp", "expected"), [
        (1, 2, {0: [0, 1]}),
        (2, 1, {0: [0], 1: [0]}),
        (4, 2, {0: [0], 1: [0], 2: [1], 3: [1]}),
        (2, 4, {0: [0, 1], 1: [2, 3]}),
    ])  # fmt: skip
    def test_tp_rank_mapping_follows_spec_1_9(self, d_tp: int, p_tp: int,
                                              expected: dict[int, list[int]]) -> None:  # fmt: skip
        eps = engines("p", "prefill", 1, p_tp) + engines("d", "decode", 1, d_tp)
        p = plan(transfer(prefill_tp=p_tp, decode_tp=d_tp), eps)
        for rank, targets in expected.items():
            peers = p.endpoint(f"d0-{rank}").peers
            assert [x.tp_rank for x in peers] == targets
            assert all(x.engine_id == "p0" and x.role == "prefill" for x in peers)
        served = {x.name for r in range(p_tp) for x in p.endpoint(f"p0-{r}").peers}
        assert served == {f"d0-{r}" for r in range(d_tp)}

    def test_prefill_per_decode_assigns_several_engines(self) -> None:
        eps = engines("p", "prefill", 3) + engines("d", "decode", 3)
        p = plan(transfer(pairing={"prefillPerDecode": 2}), eps)
        assert len(p.pairs) == 6
        assert sorted(x.engine_id for x in p.endpoint("d0-0").peers) == ["p0", "p1"]

    def test_topology_aware_prefers_same_zone(self) -> None:
        nodes = {"na": {"zone": "a"}, "nb": {"zone": "b"}}
        eps = (engines("pa", "prefill", 1, node_name="na")
               + engines("pb", "prefill", 1, node_name="nb")
               + engines("da", "decode", 2, node_name="na")
               + engines("db", "decode", 2, node_name="nb"))  # fmt: skip
        t = transfer(pairing={"policy": "TopologyAware", "topologyKey": "zone"})
        pairs = {x.decode_engine: x.prefill_engine for x in plan(t, eps, nodes).pairs}
        assert pairs == {"da0": "pa0", "da1": "pa0", "db0": "pb0", "db1": "pb0"}
        # Balanced ignores zones and interleaves by load.
        balanced = {x.decode_engine: x.prefill_engine for x in plan(transfer(), eps, nodes).pairs}
        assert sorted(balanced.values()) == ["pa0", "pa0", "pb0", "pb0"]
        assert balanced != pairs

    def test_assignments_are_sticky_when_scaling_out(self) -> None:
        base = engines("p", "prefill", 2) + engines("d", "decode", 4)
        first = plan(transfer(), base)
        grown = write_back(first, base) + engines("dn", "decode", 2)
        second = plan(transfer(), grown)
        before = {x.decode_engine: x.prefill_engine for x in first.pairs}
        after = {x.decode_engine: x.prefill_engine for x in second.pairs}
        assert all(after[d] == p for d, p in before.items())
        assert sorted(after.values()) == ["p0", "p0", "p0", "p1", "p1", "p1"]

    def test_scale_in_rebalances_over_cap(self) -> None:
        base = engines("p", "prefill", 2) + engines("d", "decode", 4)
        first = write_back(plan(transfer(), base), base)
        on_p1 = {x.decode_engine for x in plan(transfer(), first).pairs if x.prefill_engine == "p1"}
        shrunk = [e for e in first if e.engine_id not in on_p1]  # every decode on p1 goes
        pairs = plan(transfer(), shrunk).pairs
        assert sorted(x.prefill_engine for x in pairs) == ["p0", "p1"]


class TestVerdicts:
    def test_incompatible_decode_is_never_paired_and_named(self) -> None:
        bad = ep("dbad-0", "decode", "dbad", geometry={"regions": T.regions(block_len=2048)})
        p = plan(transfer(), [*engines("p", "prefill", 2), *engines("d", "decode", 1), bad])
        v = p.endpoint("dbad-0")
        assert v.state is EndpointState.INCOMPATIBLE and v.peers == ()
        assert v.message.startswith("spec.geometry.regions[0].blockLen: incompatible with every")
        assert [(x.endpoint, x.rule, x.field) for x in p.problems] == [
            ("dbad-0", "block_lens", "spec.geometry.regions[0].blockLen")
        ]
        assert cond(p, "GeometryCompatible") == ("False", "IncompatibleEndpoints")
        assert cond(p, "Degraded") == ("True", "IncompatibleEndpoints")
        assert p.incompatible_pairs == 2
        assert "dbad" not in {x.decode_engine for x in p.pairs}

    def test_hash_mismatch_follows_enforcement(self) -> None:
        other = ep("d9-0", "decode", "d9", compatibilityHash="f" * 64)
        eps = [*engines("p", "prefill", 1), other]
        assert plan(transfer(), eps).problems[0].field == "spec.compatibilityHash"
        relaxed = plan(transfer(compatibility={"enforceHash": False}), eps)
        assert relaxed.problems == () and len(relaxed.pairs) == 1

    def test_endpoint_against_transfer_spec(self) -> None:
        eps = [ep("a-0", "decode", "a", mode="push"), ep("b-0", "decode", "b", tp_size=2),
               ep("c-0", "decode", "c", protocolVersion=10)]  # fmt: skip
        p = plan(transfer(), [*engines("p", "prefill", 1), *eps])
        fields = {x.endpoint: x.field for x in p.problems}
        assert fields == {"a-0": "spec.mode", "b-0": "spec.tpSize", "c-0": "spec.protocolVersion"}
        assert "KVTransfer spec.decode.tensorParallelSize" in p.endpoint("b-0").message

    def test_push_mode_rejects_different_group_layouts_via_agent_rules(self) -> None:
        groups = T.regions(4)
        groups[1]["groupId"] = 1
        d = ep("d-0", "decode", "d", mode="push", geometry={"regions": groups})
        p = plan(transfer(mode="push"), [*engines("p", "prefill", 1, mode="push"), d])
        assert [x.rule for x in p.problems] == ["push_group_layout"]

    def test_stale_epoch_is_ignored(self) -> None:
        old = ep("p0-old", "prefill", "p0", epoch=3)
        new = ep("p0-new", "prefill", "p0", epoch=4)
        p = plan(transfer(), [old, new, *engines("d", "decode", 1)])
        assert p.endpoint("p0-old").state is EndpointState.STALE
        assert [(x.name, x.epoch) for x in p.endpoint("d0-0").peers] == [("p0-new", 4)]
        assert cond(p, "Degraded") == ("True", "StaleEndpoints")

    def test_incomplete_engine_waits(self) -> None:
        half = ep("p0-0", "prefill", "p0", tp_size=2)
        p = plan(transfer(prefill_tp=2), [half, *engines("d", "decode", 1)])
        assert p.endpoint("p0-0").reason == "EngineIncomplete"
        assert "waiting for ranks [1]" in p.endpoint("p0-0").message
        assert cond(p, "Paired") == ("False", "NoPrefillEngines")

    def test_selector_and_termination_exclude(self) -> None:
        t = transfer(decode={"tensorParallelSize": 1, "selector": {"matchLabels": {"a": "1"}}})
        eps = [*engines("p", "prefill", 1), ep("d0-0", "decode", "d0", labels={"a": "1"}),
               ep("d1-0", "decode", "d1")]  # fmt: skip
        p = plan(t, eps)
        assert p.endpoint("d1-0").reason == "NotSelected"
        gone = dataclasses.replace(eps[1], deleting=True)
        assert plan(t, [eps[0], gone]).endpoint("d0-0").reason == "Terminating"

    def test_no_endpoints(self) -> None:
        p = plan(transfer(), [])
        assert cond(p, "GeometryCompatible") == ("Unknown", "NoEndpoints")
        assert cond(p, "Ready") == ("False", "NoDecodeEngines")


class TestHandshakes:
    def test_ready_only_after_every_handshake(self) -> None:
        eps = engines("p", "prefill", 1, 2) + engines("d", "decode", 2)
        t = transfer(prefill_tp=2)
        p = plan(t, eps)
        done = plan(t, handshakes_done(p, eps))
        assert cond(done, "Ready") == ("True", "AllPairsVerified")
        assert all(x.state is PairState.VERIFIED for x in done.pairs)
        assert done.decode.verified == 2 and done.prefill.verified == 2

    def test_handshake_at_old_epoch_does_not_count(self) -> None:
        eps = engines("p", "prefill", 1) + engines("d", "decode", 1)
        verified = handshakes_done(plan(transfer(), eps), eps)
        restarted = [dataclasses.replace(e, epoch=9) if e.role == "prefill" else e
                     for e in verified]  # fmt: skip
        p = plan(transfer(), restarted)
        assert cond(p, "HandshakesVerified") == ("False", "HandshakesPending")
        assert p.endpoint("d0-0").peers[0].epoch == 9

    def test_failed_handshake_degrades(self) -> None:
        eps = engines("p", "prefill", 1) + engines("d", "decode", 1)
        p = plan(transfer(), handshakes_done(plan(transfer(), eps), eps, ok=False))
        assert cond(p, "HandshakesVerified") == ("False", "HandshakeFailed")
        assert cond(p, "Degraded") == ("True", "HandshakeFailed")
        assert "boom" in p.endpoint("d0-0").message


class TestTopologyScope:
    """TopologyAware with topologyScope Required never pairs across zones."""

    nodes: ClassVar[dict[str, dict[str, str]]] = {"node-a": {"zone": "a"},
                                                  "node-b": {"zone": "b"}}

    def eps(self, *placed: tuple[str, str, str]) -> list[Endpoint]:
        out = []
        for name, role, node in placed:
            manifest = T.endpoint_manifest(f"{name}-0", role=role, engine_id=name)
            manifest["spec"]["nodeName"] = node
            out.append(parse_endpoint(manifest))
        return out

    def test_preferred_crosses_zones_only_when_its_own_has_none(self) -> None:
        eps = self.eps(("pa", "prefill", "node-a"), ("da", "decode", "node-a"),
                       ("db", "decode", "node-b"))  # fmt: skip
        t = transfer(pairing={"policy": "TopologyAware", "topologyKey": "zone"})
        p = plan(t, eps, self.nodes)
        assert {(x.decode_engine, x.prefill_engine) for x in p.pairs} == {("da", "pa"),
                                                                         ("db", "pa")}

    def test_required_leaves_a_decode_without_a_local_prefill_unpaired_and_says_why(self) -> None:
        eps = self.eps(("pa", "prefill", "node-a"), ("da", "decode", "node-a"),
                       ("db", "decode", "node-b"))  # fmt: skip
        t = transfer(pairing={"policy": "TopologyAware", "topologyKey": "zone",
                              "topologyScope": "Required"})  # fmt: skip
        p = plan(t, eps, self.nodes)
        assert [(x.decode_engine, x.prefill_engine) for x in p.pairs] == [("da", "pa")]
        db = p.endpoint("db-0")
        assert (db.state, db.reason) == (EndpointState.UNPAIRED, "NoPrefillInTopology")
        assert "shares its topology (zone=b)" in db.message and "Required" in db.message
        # A prefill engine appears in zone b: db is paired there, da keeps its own.
        more = plan(t, eps + self.eps(("pb", "prefill", "node-b")), self.nodes)
        assert {(x.decode_engine, x.prefill_engine) for x in more.pairs} == {("da", "pa"),
                                                                            ("db", "pb")}

    def test_required_takes_a_local_prefill_above_the_balance_cap(self) -> None:
        eps = self.eps(("pa", "prefill", "node-a"), ("pb", "prefill", "node-b"),
                       ("da1", "decode", "node-a"), ("da2", "decode", "node-a"))  # fmt: skip
        t = transfer(pairing={"policy": "TopologyAware", "topologyKey": "zone",
                              "topologyScope": "Required"})  # fmt: skip
        p = plan(t, eps, self.nodes)
        assert {(x.decode_engine, x.prefill_engine) for x in p.pairs} == {("da1", "pa"),
                                                                         ("da2", "pa")}

    def test_scope_values_are_checked(self) -> None:
        with pytest.raises(SpecError) as err:
            transfer(pairing={"policy": "TopologyAware", "topologyScope": "Strict"})
        assert err.value.path == "spec.pairing.topologyScope"


class TestLostNodes:
    """Endpoints on a node that is not Ready lose their pairs; the others keep theirs."""

    def eps(self) -> list[Endpoint]:
        out = []
        for name, role, engine, node in (("p-a", "prefill", "PA", "node-a"),
                                         ("p-b", "prefill", "PB", "node-b"),
                                         ("d-a", "decode", "DA", "node-a"),
                                         ("d-b", "decode", "DB", "node-b")):  # fmt: skip
            manifest = T.endpoint_manifest(name, role=role, engine_id=engine)
            manifest["spec"]["nodeName"] = node
            out.append(parse_endpoint(manifest))
        return out

    def test_pairs_on_a_lost_node_are_dropped_and_named_then_reform(self) -> None:
        t = transfer()
        eps = self.eps()
        healthy = plan(t, handshakes_done(plan(t, eps), eps))
        assert len(healthy.pairs) == 2 and cond(healthy, "Ready")[0] == "True"
        lost = plan(t, handshakes_done(healthy, eps), lost_nodes=frozenset({"node-b"}))
        assert [(x.decode_engine, x.prefill_engine) for x in lost.pairs] == [("DA", "PA")]
        for name in ("p-b", "d-b"):
            verdict = lost.endpoint(name)
            assert (verdict.state, verdict.reason, verdict.peers) == (
                EndpointState.EXCLUDED, "NodeNotReady", ())
            assert "node node-b is not Ready" in verdict.message
        status, reason = cond(lost, "Degraded")
        assert (status, reason) == ("True", "NodeNotReady")
        message = next(c.message for c in lost.conditions if c.type == "Degraded")
        assert "2 endpoint(s) lost their pairs on node(s) not Ready (node-b): d-b, p-b" in message
        assert cond(lost, "Ready") == ("True", "AllPairsVerified")  # the rest keeps serving
        back = plan(t, handshakes_done(plan(t, eps), eps))
        assert len(back.pairs) == 2 and cond(back, "Degraded") == ("False", "AsExpected")


class TestTransports:
    """Pairs carry the transports their decode ranks report; a transport outside
    spec.transport.accepted degrades the KVTransfer, naming the rank pair."""

    eps = engines("p", "prefill", 1) + engines("d", "decode", 2)

    def reported(self, t: Transfer, transports: dict[str, str]) -> Plan:
        return plan(t, handshakes_done(plan(t, self.eps), self.eps, transports=transports))

    def test_any_transport_is_accepted_by_default(self) -> None:
        p = self.reported(transfer(), {"d0-0": "cma", "d1-0": "tcp"})
        assert [x.transports for x in p.pairs] == [("cma",), ("tcp",)]
        assert p.fallbacks == () and cond(p, "Degraded") == ("False", "AsExpected")
        written = st.transfer_status(p, None, generation=1, now="t")["pairs"]["items"]
        assert [i["transports"] for i in written] == [["cma"], ["tcp"]]

    def test_a_pair_over_a_transport_not_accepted_degrades_naming_it(self) -> None:
        t = transfer(transport={"accepted": ["cma", "rc"]})
        p = self.reported(t, {"d0-0": "rc_mlx5", "d1-0": "tcp"})
        assert [(f.endpoint, f.peer, f.transport) for f in p.fallbacks] == [
            ("d1-0", "p0-0", "tcp")]
        status, reason = cond(p, "Degraded")
        assert (status, reason) == ("True", "TransportFallback")
        message = next(c.message for c in p.conditions if c.type == "Degraded")
        assert "d1-0 <- p0-0 over tcp" in message and "[cma, rc]" in message
        assert cond(p, "Ready") == ("True", "AllPairsVerified")  # slower, not broken
        assert "TransportFallback" in p.summary

    def test_unknown_and_unreported_transports_are_never_a_fallback(self) -> None:
        t = transfer(transport={"accepted": ["cma"]})
        p = self.reported(t, {"d0-0": "unknown"})
        assert p.fallbacks == () and cond(p, "Degraded") == ("False", "AsExpected")
        assert [x.transports for x in p.pairs] == [("unknown",), ()]

    def test_a_report_at_an_old_epoch_does_not_count(self) -> None:
        t = transfer(transport={"accepted": ["cma"]})
        verified = handshakes_done(plan(t, self.eps), self.eps, transports={"d0-0": "tcp"})
        restarted = [dataclasses.replace(e, epoch=9) if e.role == "prefill" else e
                     for e in verified]  # fmt: skip
        assert plan(t, restarted).fallbacks == ()

    @pytest.mark.parametrize("bad", ["TCP", "", "rc mlx5", 7])
    def test_accepted_names_are_checked(self, bad: Any) -> None:
        with pytest.raises(SpecError) as err:
            transfer(transport={"accepted": ["cma", bad]})
        assert err.value.path == "spec.transport.accepted[1]"

    def test_metrics_follow_the_pairs_transports(self) -> None:
        from prometheus_client import REGISTRY

        from kvbridge_operator import metrics

        def value(name: str, **labels: str) -> float | None:
            return REGISTRY.get_sample_value(name, {"namespace": "ns", "transfer": "tm",
                                                    **labels})  # fmt: skip

        t = transfer(transport={"accepted": ["cma"]})
        metrics.record("ns", "tm", self.reported(t, {"d0-0": "cma", "d1-0": "tcp"}))
        pair = {"decode_engine": "d1", "prefill_engine": "p0"}
        assert value("kvbridge_pair_transport", **pair, transport="tcp") == 1
        assert value("kvbridge_transport_fallback_pairs") == 1
        metrics.record("ns", "tm", self.reported(t, {"d0-0": "cma", "d1-0": "cma"}))
        assert value("kvbridge_pair_transport", **pair, transport="tcp") is None
        assert value("kvbridge_pair_transport", **pair, transport="cma") == 1
        assert value("kvbridge_transport_fallback_pairs") == 0
        metrics.forget("ns", "tm")
        assert value("kvbridge_pair_transport", **pair, transport="cma") is None


class TestPushHandshakes:
    """In push mode the prefill rank writes into the decode rank's memory: a pair is verified
    only when both sides report their handshake."""

    def setup_method(self) -> None:
        self.kvt = transfer(mode="push")
        self.eps = engines("p", "prefill", 1, mode="push") + engines("d", "decode", 1,
                                                                      mode="push")

    def test_decode_report_alone_is_not_enough(self) -> None:
        eps = handshakes_done(plan(self.kvt, self.eps), self.eps)
        p = plan(self.kvt, eps)
        assert cond(p, "HandshakesVerified") == ("False", "HandshakesPending")
        assert "both sides" in p.endpoint("d0-0").message

    def test_both_reports_verify(self) -> None:
        first = plan(self.kvt, self.eps)
        eps = prefill_reports(first, handshakes_done(first, self.eps))
        p = plan(self.kvt, eps)
        assert cond(p, "Ready") == ("True", "AllPairsVerified")

    def test_prefill_side_failure_degrades_and_names_the_reporter(self) -> None:
        first = plan(self.kvt, self.eps)
        eps = prefill_reports(first, handshakes_done(first, self.eps), ok=False)
        p = plan(self.kvt, eps)
        assert cond(p, "Degraded") == ("True", "HandshakeFailed")
        assert "handshake of p0-0 with d0-0" in p.endpoint("d0-0").message
        assert "refused by decode" in p.endpoint("d0-0").message

    def test_pull_mode_ignores_prefill_reports(self) -> None:
        eps = engines("p", "prefill", 1) + engines("d", "decode", 1)
        first = plan(transfer(), eps)
        p = plan(transfer(), prefill_reports(first, handshakes_done(first, eps), ok=False))
        assert cond(p, "Ready") == ("True", "AllPairsVerified")


class TestDeterminism:
    @pytest.mark.parametrize("seed", range(8))
    def test_same_input_same_plan_and_fixpoint(self, seed: int) -> None:
        rng = random.Random(seed)
        p_tp, d_tp = rng.choice([(1, 1), (2, 1), (1, 2), (2, 4)])
        eps = (engines("p", "prefill", rng.randint(1, 5), p_tp)
               + engines("d", "decode", rng.randint(1, 12), d_tp))  # fmt: skip
        bad = rng.sample(eps, k=min(2, len(eps)))
        eps = [dataclasses.replace(e, compatibility_hash="a" * 64) if e in bad else e
               for e in eps]  # fmt: skip
        t = transfer(prefill_tp=p_tp, decode_tp=d_tp,
                     pairing={"prefillPerDecode": rng.randint(1, 3)})  # fmt: skip
        first = plan(t, eps)
        shuffled = eps[:]
        rng.shuffle(shuffled)
        assert plan(t, shuffled) == first
        # The operator writes peers back and restarts: the plan must not move.
        again = plan(t, write_back(first, eps))
        assert again == first
        assert plan(t, write_back(again, shuffled)) == first


def test_endpoint_field_maps_wire_names_to_kvendpoint_paths() -> None:
    assert endpoint_field("block_lens[3]") == "spec.geometry.regions[3].blockLen"
    assert endpoint_field("region_names[0]") == "spec.geometry.regions[0].name"
    assert endpoint_field("len(block_lens)") == "spec.geometry.regions"
    assert endpoint_field("region_group_ids") == "spec.geometry.regions[*].groupId"
    assert endpoint_field("compatibility_hash") == "spec.compatibilityHash"
    assert endpoint_field("kv_cache_layout") == "spec.geometry.kvCacheLayout"


def test_conditions_keep_transition_time_unless_status_changes() -> None:
    eps = engines("p", "prefill", 1) + engines("d", "decode", 1)
    p = plan(transfer(), eps)
    s1 = st.transfer_status(p, None, generation=1, now="2025-01-01T00:00:00Z")
    s2 = st.transfer_status(p, s1, generation=2, now="2025-01-02T00:00:00Z")
    assert [c["lastTransitionTime"] for c in s2["conditions"]] == ["2025-01-01T00:00:00Z"] * 6
    assert {c["observedGeneration"] for c in s2["conditions"]} == {2}
    done = plan(transfer(), handshakes_done(p, eps))
    s3 = st.transfer_status(done, s2, generation=2, now="2025-01-03T00:00:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in s3["conditions"]}
    assert times["Ready"] == times["HandshakesVerified"] == "2025-01-03T00:00:00Z"
    assert times["Paired"] == "2025-01-01T00:00:00Z"
    assert [c["type"] for c in st.transitions(s2["conditions"], s3["conditions"])] == [
        "HandshakesVerified", "Ready"
    ]  # fmt: skip
