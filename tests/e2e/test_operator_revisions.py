"""The operator on a real control plane with two model revisions in one KVTransfer (issue
#35): pairs form within a revision only, status.revisions counts each, RevisionsMatched says
whether each has both roles, and a decode of a revision no prefill serves is Incompatible."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge_testkit.e2e import Api, wait_for

pytestmark = pytest.mark.k8s

OLD_FP, NEW_FP = "sampled-v1:" + "1" * 64, "sampled-v1:" + "2" * 64
OLD = {"model": {"name": "m", "revision": "r1", "fingerprint": OLD_FP}}
NEW = {"model": {"name": "m", "revision": "r2", "fingerprint": NEW_FP}}


def _revisions(api: Api, ns: str) -> dict[str, tuple[int, int, int]]:
    status = api.transfer(ns).get("status") or {}
    return {r.get("revision", ""): (r.get("prefills", 0), r.get("decodes", 0), r.get("pairs", 0))
            for r in status.get("revisions") or []}  # fmt: skip


def _pairs(api: Api, ns: str) -> set[tuple[str, str]]:
    items = ((api.transfer(ns).get("status") or {}).get("pairs") or {}).get("items") or []
    return {(p["decodeEngine"], p["prefillEngine"]) for p in items}


def _model(api: Api, ns: str, engine: str) -> Any:
    return api.endpoint(ns, f"{engine}-0")["spec"]["model"]["fingerprint"]


def test_two_revisions_pair_within_their_revision(api: Api, ns: str) -> None:
    api.create_transfer(ns, prefill_tp=1, decode_tp=1)
    for engine, role, model in (("p-old", "prefill", OLD), ("d-old", "decode", OLD),
                                ("d-new", "decode", NEW)):
        api.start_engine(ns, engine, role, tp_size=1, **model)

    # Mid-rollout: the decodes of r2 came up before any prefill of r2.
    cond = api.wait_condition(ns, "RevisionsMatched", "False", reason="RevisionWithoutPrefill")
    assert cond["message"].startswith("revision r2 ")
    wait_for(lambda: _revisions(api, ns) == {"r1": (1, 1, 1), "r2": (0, 1, 0)},
             what="status.revisions mid-rollout")  # fmt: skip
    lone = wait_for(lambda: (s := api.endpoint(ns, "d-new-0").get("status") or {})
                    .get("state") == "Incompatible" and s, what="d-new Incompatible")
    assert lone["peers"] == []
    assert "spec.model.fingerprint" in lone["message"]
    assert OLD_FP in lone["message"] and NEW_FP in lone["message"]
    assert _pairs(api, ns) == {("d-old", "p-old")}

    api.start_engine(ns, "p-new", "prefill", tp_size=1, **NEW)
    cond = api.wait_condition(ns, "RevisionsMatched", "True", reason="AllRevisionsPaired")
    wait_for(lambda: _revisions(api, ns) == {"r1": (1, 1, 1), "r2": (1, 1, 1)},
             what="status.revisions with both revisions paired")  # fmt: skip
    wait_for(lambda: len(_pairs(api, ns)) == 2, what="2 pairs")
    pairs = _pairs(api, ns)
    assert pairs == {("d-old", "p-old"), ("d-new", "p-new")}
    for decode, prefill in pairs:  # no pair crosses revisions
        assert _model(api, ns, decode) == _model(api, ns, prefill)
    peers = {p["name"] for p in api.endpoint(ns, "d-new-0")["status"]["peers"]}
    assert peers == {"p-new-0"}
    api.report_handshakes(ns)
    api.wait_condition(ns, "Ready", "True")
