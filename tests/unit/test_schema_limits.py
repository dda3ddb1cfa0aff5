"""The largest objects the CRDs admit fit the path every object takes (etcd, annotations, the
webhook's request size), and the operator's and agent's status writes stay inside the
schemas' bounds. The same objects are created on a real control plane in
tests/e2e/test_limits.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.service import HANDSHAKE_MESSAGE_MAX, TRANSPORT_MAX, PeerReport
from kvbridge_operator import admission, limits, status
from kvbridge_operator import testing as T
from kvbridge_operator.model import EndpointPlan, EndpointState, Peer
from kvbridge_operator.spec import parse_endpoint
from kvbridge_operator.webhook import MAX_REVIEW_BYTES

CRDS = Path(__file__).resolve().parents[2] / "crds"


def _schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"kvbridge.io_{plural}.yaml").read_text())
    return limits.crd_schema(crd)


def _bound(plural: str, path: str, key: str) -> int:
    node: Any = _schema(plural)
    for part in path.split("."):
        node = node["items"] if part == "*" else node["properties"][part]
    return int(node[key])


@pytest.mark.parametrize("plural", ["kvendpoints", "kvtransfers"])
def test_largest_object_fits_etcd_and_the_webhook(plural: str) -> None:
    schema = _schema(plural)
    largest = limits.largest(schema)  # raises UnboundedError naming any unbounded field
    assert set(largest) >= {"spec", "status"}
    bounded = limits.size(largest)
    assert bounded <= limits.OBJECT_BUDGET, f"{plural}: {bounded} bytes"
    # The rest of etcd's limit is left for metadata: all the annotations the apiserver allows.
    assert limits.OBJECT_BUDGET + limits.ANNOTATIONS_BYTES < limits.ETCD_REQUEST_BYTES
    # An UPDATE's review carries the object and its old version, each as large as etcd takes.
    assert 2 * limits.ETCD_REQUEST_BYTES + 64 * 1024 < MAX_REVIEW_BYTES


def test_largest_kvtransfer_spec_fits_kubectl_apply_annotation() -> None:
    spec = limits.largest(_schema("kvtransfers")["properties"]["spec"], "spec")
    assert limits.size(spec) <= limits.APPLIED_SPEC_BUDGET <= limits.ANNOTATIONS_BYTES // 2


def test_largest_valid_objects_pass_admission_and_are_the_largest() -> None:
    ep_schema, t_schema = _schema("kvendpoints"), _schema("kvtransfers")
    endpoint = T.largest_endpoint(ep_schema, "big")
    transfer = T.largest_transfer(t_schema, "big")
    assert admission.check_endpoint(endpoint) == []
    assert admission.check_transfer(transfer) == []
    # What the webhook asks for costs a few bytes at most (the protocol version, a name).
    for obj, schema in ((endpoint, ep_schema), (transfer, t_schema)):
        worst = limits.size(limits.largest(schema["properties"]["spec"], "spec"))
        assert worst - 300 <= limits.size(obj["spec"]) <= worst


def test_unbounded_fields_are_named() -> None:
    schema = {"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}}}
    with pytest.raises(limits.UnboundedError, match=r"spec\.items: an array without maxItems"):
        limits.largest(schema)
    with pytest.raises(limits.UnboundedError, match=r"x: a string without maxLength"):
        limits.largest({"type": "object", "properties": {"x": {"type": "string"}}})
    with pytest.raises(limits.UnboundedError, match="a map without maxProperties"):
        limits.largest({"type": "object", "additionalProperties": {"type": "string"}})


def test_largest_takes_every_bound() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -1, "maximum": 1023},
        "big": {"type": "integer", "format": "int64", "minimum": 0},
        "e": {"type": "string", "enum": ["In", "DoesNotExist"]},
        "s": {"type": "string", "maxLength": 5, "pattern": "^[A-Z]+$"},
        "a": {"type": "array", "maxItems": 3, "items": {"type": "boolean"}},
        "m": {"type": "object", "maxProperties": 2, "additionalProperties": {"type": "string",
                                                                              "maxLength": 1}},
    }}  # fmt: skip
    got = limits.largest(schema)
    assert got["n"] == 1023 and got["big"] == 2**63 - 1 and got["e"] == "DoesNotExist"
    assert got["s"] == "AAAAA" and got["a"] == [False] * 3
    assert list(got["m"].values()) == ["a", "a"]
    assert all(len(k) == 317 for k in got["m"])


def _peer(i: int) -> Peer:
    return Peer(f"p-{i}", "engine-p", "prefill", "10.0.0.1", 5600, i, 256, 1)


def test_endpoint_status_lists_at_most_the_schema_bound_and_says_how_many() -> None:
    bound = _bound("kvendpoints", "status.peers", "maxItems")
    assert bound == status.MAX_PEERS_LISTED
    e = parse_endpoint(T.endpoint_manifest("d-0", role="decode", engine_id="d"))
    peers = tuple(_peer(i) for i in range(bound + 5))
    verdict = EndpointPlan("d-0", "decode", EndpointState.PAIRED, "HandshakesPending",
                           "m" * 10_000, peers)  # fmt: skip
    written = status.endpoint_status(verdict, e)
    assert [p["name"] for p in written["peers"]] == [f"p-{i}" for i in range(bound)]
    assert written["message"].startswith(
        f"{bound + 5} peers assigned, only the first {bound} are listed in status.peers")
    assert len(written["message"]) <= _bound("kvendpoints", "status.message", "maxLength")
    few = status.endpoint_status(EndpointPlan("d-0", "decode", EndpointState.PAIRED, "R", "ok",
                                              peers[:2]), e)  # fmt: skip
    assert few["message"] == "ok" and len(few["peers"]) == 2


def test_operator_and_agent_cut_messages_to_the_schema_bounds() -> None:
    t = "kvtransfers"
    assert _bound(t, "status.conditions.*.message", "maxLength") == status.MAX_CONDITION_MESSAGE
    assert _bound(t, "status.incompatible.*.message", "maxLength") == status.MAX_PROBLEM_MESSAGE
    assert _bound(t, "status.incompatible.*.field", "maxLength") == status.MAX_PROBLEM_FIELD
    assert _bound(t, "status.pairs.items", "maxItems") == status.MAX_PAIRS_LISTED
    assert _bound(t, "status.incompatible", "maxItems") == status.MAX_PROBLEMS_LISTED
    pair = "status.pairs.items.*.transports"
    assert _bound(t, pair, "maxItems") == status.MAX_PAIR_TRANSPORTS
    assert _bound(t, f"{pair}.*", "maxLength") == status.MAX_TRANSPORT_NAME
    assert _bound("kvendpoints", "status.handshakes.*.transport", "maxLength") == TRANSPORT_MAX
    detail = _bound("kvendpoints", "status.handshakes.*.transportDetail", "maxLength")
    assert detail == HANDSHAKE_MESSAGE_MAX
    assert _bound("kvendpoints", "status.message", "maxLength") >= status.MAX_ENDPOINT_MESSAGE
    bound = _bound("kvendpoints", "status.handshakes.*.message", "maxLength")
    assert bound == HANDSHAKE_MESSAGE_MAX
    report = PeerReport("p-0", "engine-p", 1, False, message="x" * 10_000)
    assert len(report.to_status()["message"]) == bound
    long = PeerReport("p-0", "engine-p", 1, True, transport="t" * 500, transport_detail="d" * 9999)
    assert len(long.to_status()["transport"]) == TRANSPORT_MAX
    assert len(long.to_status()["transportDetail"]) == bound


def test_transfer_update_that_keeps_the_spec_is_always_admitted() -> None:
    """kopf's finalizer removal must never be refused, even for a spec stored before a rule."""
    bad = T.transfer_manifest("t", protocolVersion=12)
    assert admission.check_transfer(bad) != []
    assert admission.check_transfer(bad, old=bad) == []
    changed = T.transfer_manifest("t", protocolVersion=13)
    assert admission.check_transfer(changed, old=bad) != []
    deleting = {**changed, "metadata": {"name": "t", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert admission.check_transfer(deleting, old=bad) == []


def test_decode_rank_peers_must_fit_status_peers() -> None:
    """prefillPerDecode times the prefill ranks each decode rank reads from is at most the
    peers bound, so that a decode rank's peers are never cut."""
    bound = _bound("kvendpoints", "status.peers", "maxItems")
    ok = T.transfer_manifest(prefill_tp=8, decode_tp=2, pairing={"prefillPerDecode": bound // 4})
    assert admission.check_transfer(ok) == []
    over = T.transfer_manifest(prefill_tp=8, decode_tp=2,
                               pairing={"prefillPerDecode": bound // 4 + 1})  # fmt: skip
    assert admission.check_transfer(over) == [
        f"spec.pairing.prefillPerDecode: expected at most {bound // 4} with 4 prefill rank(s) "
        f"per decode rank, got {bound // 4 + 1}; a decode rank's peers (prefillPerDecode x 4) "
        f"must fit status.peers (at most {bound})"
    ]
    wide = T.transfer_manifest(prefill_tp=2 * bound, decode_tp=1)
    assert admission.check_transfer(wide)[0].startswith(
        f"spec.prefill.tensorParallelSize: expected at most {bound} times "
        "spec.decode.tensorParallelSize (1), got 256")
    # Decode TP above prefill TP: one prefill rank per decode rank.
    assert admission.check_transfer(T.transfer_manifest(
        prefill_tp=1, decode_tp=8, pairing={"prefillPerDecode": 64})) == []
