"""Objects at the limits: the largest KVEndpoint and KVTransfer the CRD schemas admit are
created, updated through the admission webhook, get their status from the operator and are
deleted (a KVTransfer's finalizer released); one just past each bound is refused at apply
time naming the field. Sizes are worked out from the CRDs themselves (kvbridge_operator.limits),
so a bound changed in a CRD is tested as it is.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from kvbridge_operator import limits
from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS, TRANSFERS
from kvbridge_testkit.e2e import REPO, Api, wait_for

pytestmark = pytest.mark.k8s

SCHEMAS = {
    plural: limits.crd_schema(yaml.safe_load((REPO / "crds" / f"kvbridge.io_{plural}.yaml")
                                             .read_text()))
    for plural in (ENDPOINTS, TRANSFERS)
}  # fmt: skip
#: Generous: the operator answers within a second or two on an idle control plane.
TIMEOUT = 30.0
#: kopf's copy of the object, as operators before kvbridge_operator.persistence kept it.
STALE_DIFFBASE = "kvbridge.io/last-handled-configuration"


def _observed(api: Api, plural: str, ns: str, name: str, generation: int) -> bool:
    status = api.get(plural, ns, name).get("status") or {}
    return status.get("observedGeneration") == generation


def _gone(api: Api, plural: str, ns: str, name: str) -> bool:
    try:
        api.get(plural, ns, name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def _update_delete(api: Api, plural: str, ns: str, name: str, spec_change: dict) -> None:
    """The largest status the schema admits, then a spec update through the webhook (the
    AdmissionReview carries both versions of the whole object); the operator answers the
    new generation; then a delete that completes."""
    api.patch_status(plural, ns, name, manifests.largest_status(SCHEMAS[plural]))
    updated = api.patch(plural, ns, name, {"spec": spec_change})
    assert updated["metadata"]["generation"] == 2
    wait_for(lambda: _observed(api, plural, ns, name, 2), timeout=TIMEOUT,
             what=f"operator status for {plural}/{name} generation 2")  # fmt: skip
    api.delete(plural, ns, name)
    wait_for(lambda: _gone(api, plural, ns, name), timeout=TIMEOUT, what=f"{plural}/{name} gone")


def test_largest_kvendpoint_is_created_updated_and_deleted(api: Api, ns: str) -> None:
    api.create_transfer(ns)
    body = manifests.largest_endpoint(SCHEMAS[ENDPOINTS], "big")
    created = api.create(ENDPOINTS, ns, body)
    assert limits.size(created["spec"]) == limits.size(body["spec"]) > 500_000
    wait_for(lambda: _observed(api, ENDPOINTS, ns, "big", 1), timeout=TIMEOUT,
             what="operator status for the largest KVEndpoint")  # fmt: skip
    _update_delete(api, ENDPOINTS, ns, "big", {"sideChannel": {"port": 5601}})


def test_largest_kvtransfer_is_created_updated_and_deleted(api: Api, ns: str) -> None:
    body = manifests.largest_transfer(SCHEMAS[TRANSFERS], "big")
    created = api.create(TRANSFERS, ns, body)
    assert limits.size(created["spec"]) == limits.size(body["spec"])
    wait_for(lambda: _observed(api, TRANSFERS, ns, "big", 1), timeout=TIMEOUT,
             what="operator status for the largest KVTransfer")  # fmt: skip
    _update_delete(api, TRANSFERS, ns, "big", {"sideChannelPort": 5601})


def test_kvtransfer_with_large_annotations_is_deleted(api: Api, ns: str) -> None:
    """Annotations no schema bounds, 200 KB of the apiserver's 256 KiB: kopf must not copy
    them into an annotation of its own, or the finalizer is never removed. The copy an
    earlier operator left is removed."""
    body = manifests.transfer_manifest("annotated")
    body["metadata"]["annotations"] = {"example.com/notes": "n" * 200_000,
                                       STALE_DIFFBASE: '{"spec":{}}'}  # fmt: skip
    api.create(TRANSFERS, ns, body)
    wait_for(lambda: _observed(api, TRANSFERS, ns, "annotated", 1), timeout=TIMEOUT,
             what="operator status")  # fmt: skip
    wait_for(lambda: STALE_DIFFBASE not in api.get(TRANSFERS, ns, "annotated")["metadata"][
        "annotations"], timeout=TIMEOUT, what="the old diff base removed")  # fmt: skip
    assert api.patch(TRANSFERS, ns, "annotated", {"spec": {"sideChannelPort": 5601}})
    wait_for(lambda: _observed(api, TRANSFERS, ns, "annotated", 2), timeout=TIMEOUT,
             what="operator status for generation 2")  # fmt: skip
    api.delete(TRANSFERS, ns, "annotated")
    wait_for(lambda: _gone(api, TRANSFERS, ns, "annotated"), timeout=TIMEOUT,
             what="KVTransfer gone (finalizer released)")  # fmt: skip


def test_decode_peers_beyond_the_peers_bound_are_refused(api: Api, ns: str) -> None:
    """A decode rank's peers are prefillPerDecode times the prefill ranks it reads from;
    beyond status.peers' bound the webhook refuses the KVTransfer, naming the field."""
    bound = _bound(ENDPOINTS, "status.peers", "maxItems")
    body = manifests.transfer_manifest("wide", prefill_tp=4, decode_tp=1,
                                       pairing={"prefillPerDecode": bound // 4 + 1})  # fmt: skip
    with pytest.raises(ApiException) as info:
        api.create(TRANSFERS, ns, body)
    assert f"spec.pairing.prefillPerDecode: expected at most {bound // 4} with 4" in json.loads(
        info.value.body)["message"]
    body["spec"]["pairing"]["prefillPerDecode"] = bound // 4
    api.create(TRANSFERS, ns, body)
    api.wait_condition(ns, "Ready", "False", name="wide", timeout=TIMEOUT)  # no endpoints yet


# -- one past each bound ---------------------------------------------------------------------

Mutate = Callable[[dict[str, Any]], None]


def _bound(plural: str, path: str, key: str) -> int:
    """``key`` (maxItems, maxLength, maxProperties) of the field at dotted ``path``."""
    node: Any = SCHEMAS[plural]
    for part in path.split("."):
        node = node["items"] if part == "*" else node["properties"][part]
    return int(node[key])


def _one_more(path: str) -> Mutate:
    """Append one more item (a copy of the last) to the array at ``path``."""
    def mutate(obj: dict[str, Any]) -> None:
        node = _at(obj, path)
        node.append(copy.deepcopy(node[-1]))
    return mutate


def _longer(path: str) -> Mutate:
    """Make the string at ``path`` one character longer."""
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = _at(obj, ".".join(parents))
        node[last] += "a"
    return mutate


def _plus_one(path: str) -> Mutate:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        _at(obj, ".".join(parents))[last] += 1
    return mutate


def _extra_label(path: str) -> Mutate:
    def mutate(obj: dict[str, Any]) -> None:
        labels = _at(obj, path)
        labels[limits.longest_label_key(len(labels))] = "v"
    return mutate


def _at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else obj[part]
    return obj


# (id, plural, part, mutation of the largest spec or status, the field, its bound's key)
PAST: list[tuple[str, str, str, Mutate, str, str]] = [
    ("regions", ENDPOINTS, "spec", _one_more("geometry.regions"),
     "spec.geometry.regions", "maxItems"),
    ("region-name", ENDPOINTS, "spec", _longer("geometry.regions.0.name"),
     "spec.geometry.regions.*.name", "maxLength"),
    ("peers", ENDPOINTS, "status", _one_more("peers"), "status.peers", "maxItems"),
    ("peer-host", ENDPOINTS, "status", _longer("peers.0.host"),
     "status.peers.*.host", "maxLength"),
    ("handshakes", ENDPOINTS, "status", _one_more("handshakes"), "status.handshakes",
     "maxItems"),
    ("handshake-message", ENDPOINTS, "status", _longer("handshakes.0.message"),
     "status.handshakes.*.message", "maxLength"),
    ("match-labels", TRANSFERS, "spec", _extra_label("prefill.selector.matchLabels"),
     "spec.prefill.selector.matchLabels", "maxProperties"),
    ("match-expressions", TRANSFERS, "spec", _one_more("decode.selector.matchExpressions"),
     "spec.decode.selector.matchExpressions", "maxItems"),
    ("expression-values", TRANSFERS, "spec",
     _one_more("prefill.selector.matchExpressions.0.values"),
     "spec.prefill.selector.matchExpressions.*.values", "maxItems"),
    ("num-regions", TRANSFERS, "spec", _plus_one("prefill.expectedGeometry.numRegions"),
     "spec.prefill.expectedGeometry.numRegions", "maximum"),
    ("conditions", TRANSFERS, "status", _one_more("conditions"), "status.conditions",
     "maxItems"),
    ("condition-message", TRANSFERS, "status", _longer("conditions.0.message"),
     "status.conditions.*.message", "maxLength"),
    ("pair-engine", TRANSFERS, "status", _longer("pairs.items.0.decodeEngine"),
     "status.pairs.items.*.decodeEngine", "maxLength"),
    ("problem-message", TRANSFERS, "status", _longer("incompatible.0.message"),
     "status.incompatible.*.message", "maxLength"),
]  # fmt: skip


@pytest.fixture(scope="module")
def limits_ns(api: Api, operator: Any) -> Iterator[str]:
    name = f"limits-{uuid.uuid4().hex[:5]}"
    api.core.create_namespace({"metadata": {"name": name}})
    api.create(ENDPOINTS, name, manifests.endpoint_manifest("small", role="decode",
                                                             engine_id="e", transfer="none"))
    api.create(TRANSFERS, name, manifests.transfer_manifest("small"))
    yield name
    api.delete(TRANSFERS, name, "small")
    wait_for(lambda: _gone(api, TRANSFERS, name, "small"), timeout=TIMEOUT, what="cleanup")
    api.core.delete_namespace(name)


@pytest.mark.parametrize(("plural", "part", "mutate", "field", "key"), [c[1:] for c in PAST],
                         ids=[c[0] for c in PAST])  # fmt: skip
def test_one_past_a_bound_is_refused_naming_the_field(
    api: Api, limits_ns: str, plural: str, part: str, mutate: Mutate, field: str, key: str
) -> None:
    schema = SCHEMAS[plural]
    with pytest.raises(ApiException) as info:
        if part == "spec":
            largest = {ENDPOINTS: manifests.largest_endpoint, TRANSFERS: manifests.largest_transfer}
            body = largest[plural](schema, "past")
            mutate(body["spec"])
            api.create(plural, limits_ns, body)
        else:
            status = manifests.largest_status(schema)
            mutate(status)
            api.patch_status(plural, limits_ns, "small", status)
    assert info.value.status == 422, info.value.body
    message = json.loads(info.value.body)["message"]
    # Kubernetes 1.20 names list items without their index: spec.geometry.regions.name
    assert f"{field.replace('.*', '')} in body should" in message
    want = {"maxItems": "have at most {} items", "maxLength": "be at most {} chars long",
            "maxProperties": "have at most {} properties",
            "maximum": "be less than or equal to {}"}[key]  # fmt: skip
    assert want.format(_bound(plural, field, key)) in message
