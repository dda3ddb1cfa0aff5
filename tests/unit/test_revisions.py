"""Engines of different model weights never pair; two revisions in one KVTransfer pair within
their revision, and the KVTransfer status counts each one (issue #35). Planner only, no
cluster."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from kvbridge_agent.resources import (
    REVISION_FIELDS,
    ConditionStatus,
    ConditionType,
    RevisionReason,
    revision_label,
)
from kvbridge_operator import metrics as om
from kvbridge_operator import status as st
from kvbridge_operator import testing as T
from kvbridge_operator.planner import EndpointState, Plan, plan
from kvbridge_operator.spec import Endpoint, parse_endpoint, parse_transfer

OLD_FP = "sampled-v1:" + "a" * 64
NEW_FP = "sampled-v1:" + "b" * 64


def model(fingerprint: str = "", revision: str = "", name: str = "m") -> dict[str, Any]:
    return {"model": {k: v for k, v in (("name", name), ("revision", revision),
                                        ("fingerprint", fingerprint)) if v}}  # fmt: skip


def engines(prefix: str, role: str, n: int, tp: int = 1, **spec: Any) -> list[Endpoint]:
    return [parse_endpoint(m) for i in range(n)
            for m in T.engine_manifests(f"{prefix}{i}", role, tp, **spec)]  # fmt: skip


def run(eps: list[Endpoint], **kw: Any) -> Plan:
    return plan(parse_transfer(T.transfer_manifest(**kw)), eps)


def condition(p: Plan) -> Any:
    return next(c for c in p.conditions if c.type == ConditionType.REVISIONS_MATCHED)


def test_two_revisions_pair_within_their_revision() -> None:
    old, new = model(OLD_FP, "r1"), model(NEW_FP, "r2")
    eps = (engines("p-old", "prefill", 2, **old) + engines("d-old", "decode", 2, **old)
           + engines("p-new", "prefill", 1, **new) + engines("d-new", "decode", 3, **new))
    p = run(eps)
    assert len(p.pairs) == 5
    for pair in p.pairs:
        assert pair.decode_engine.split("-")[1][:3] == pair.prefill_engine.split("-")[1][:3]
    assert all(e.state is EndpointState.PAIRED for e in p.endpoints)
    assert not p.problems
    by_rev = {r.identity.revision: (r.prefills, r.decodes, r.pairs) for r in p.revisions}
    assert by_rev == {"r1": (2, 2, 2), "r2": (1, 3, 3)}
    c = condition(p)
    assert (c.status, c.reason) == (ConditionStatus.TRUE, RevisionReason.ALL_PAIRED)
    status = st.transfer_status(p, None, generation=1, now="2025-01-01T00:00:00Z")
    assert status["revisions"] == [
        {"model": "m", "revision": "r1", "fingerprint": OLD_FP, "prefills": 2, "decodes": 2,
         "pairs": 2},
        {"model": "m", "revision": "r2", "fingerprint": NEW_FP, "prefills": 1, "decodes": 3,
         "pairs": 3},
    ]
    assert {f.key for f in REVISION_FIELDS} == set(status["revisions"][0])


def test_decode_of_a_revision_without_prefill_is_incompatible_naming_both_fingerprints() -> None:
    eps = (engines("p-old", "prefill", 1, **model(OLD_FP))
           + engines("d-old", "decode", 1, **model(OLD_FP))
           + engines("d-new", "decode", 1, **model(NEW_FP)))
    p = run(eps)
    assert [(x.decode_engine, x.prefill_engine) for x in p.pairs] == [("d-old0", "p-old0")]
    lone = p.endpoint("d-new0-0")
    assert lone.state is EndpointState.INCOMPATIBLE
    assert "spec.model.fingerprint" in lone.message
    assert OLD_FP in lone.message and NEW_FP in lone.message
    [problem] = p.problems
    assert (problem.endpoint, problem.field) == ("d-new0-0", "spec.model.fingerprint")
    c = condition(p)
    assert (c.status, c.reason) == (ConditionStatus.FALSE, RevisionReason.WITHOUT_PREFILL)
    assert NEW_FP.split(":")[1][:12] in c.message and "1 decode" in c.message
    counts = {r.identity.fingerprint: (r.prefills, r.decodes, r.pairs) for r in p.revisions}
    assert counts == {OLD_FP: (1, 1, 1), NEW_FP: (0, 1, 0)}


def test_revision_mismatch_names_the_revision_field() -> None:
    eps = (engines("p", "prefill", 1, **model(OLD_FP, "r1"))
           + engines("d", "decode", 1, **model(OLD_FP, "r2"))
           + engines("q", "prefill", 1, **model(OLD_FP, "r2")))
    p = run(eps)
    assert [(x.decode_engine, x.prefill_engine) for x in p.pairs] == [("d0", "q0")]
    odd = p.endpoint("p0-0")  # the prefill of no decode's revision
    assert odd.state is EndpointState.INCOMPATIBLE
    assert "spec.model.revision" in odd.message and "'r1'" in odd.message
    assert "'r2'" in odd.message
    c = condition(p)
    assert (c.status, c.reason) == (ConditionStatus.FALSE, RevisionReason.WITHOUT_DECODE)
    assert c.message.startswith("revision r1 ")


def test_a_fingerprint_does_not_pair_with_none_and_one_stated_revision_does() -> None:
    p = run(engines("p", "prefill", 1) + engines("d", "decode", 1, **model(OLD_FP)))
    assert not p.pairs
    assert "(none)" in p.endpoint("d0-0").message
    p = run(engines("p", "prefill", 1, **model(OLD_FP, "r1"))
            + engines("d", "decode", 1, **model(OLD_FP)))
    assert len(p.pairs) == 1  # a revision stated on one side only does not split them
    c = condition(p)
    assert (c.status, c.reason) == (ConditionStatus.TRUE, RevisionReason.ALL_PAIRED)


def test_endpoints_without_identity_pair_as_before() -> None:
    p = run(engines("p", "prefill", 2) + engines("d", "decode", 2))
    assert len(p.pairs) == 2
    [r] = p.revisions
    assert (r.identity.label, r.prefills, r.decodes, r.pairs) == ("unknown", 2, 2, 2)
    assert condition(p).status == ConditionStatus.TRUE
    empty = run([])
    assert condition(empty).status == ConditionStatus.UNKNOWN


def test_revision_label() -> None:
    assert revision_label("r1", OLD_FP) == "r1"
    assert revision_label("", NEW_FP) == "b" * 12
    assert revision_label("", "") == "unknown"


def test_revision_metrics_follow_the_plan() -> None:
    old, new = model(OLD_FP, "r1"), model(NEW_FP)
    p = run(engines("p-old", "prefill", 1, **old) + engines("d-old", "decode", 1, **old)
            + engines("d-new", "decode", 2, **new))
    om.record("ns-rev", "kvt", p)

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"namespace": "ns-rev", "transfer": "kvt",
                                                **labels})

    assert value("kvbridge_transfer_revision_pairs", revision="r1") == 1
    assert value("kvbridge_transfer_revision_pairs", revision="b" * 12) == 0
    assert value("kvbridge_transfer_revision_engines", revision="b" * 12, role="decode") == 2
    om.record("ns-rev", "kvt", run(engines("p-old", "prefill", 1, **old)
                                   + engines("d-old", "decode", 1, **old)))
    assert value("kvbridge_transfer_revision_pairs", revision="b" * 12) is None
    om.forget("ns-rev", "kvt")
    assert value("kvbridge_transfer_revision_pairs", revision="r1") is None
