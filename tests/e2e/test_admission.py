"""Malformed KVTransfers and KVEndpoints are rejected by the CRD schema or the webhook, with a
message naming the field."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS, TRANSFERS
from kvbridge_testkit.e2e import Api

pytestmark = pytest.mark.k8s

Mutate = Callable[[dict[str, Any]], None]


def _ep(role: str = "decode") -> dict[str, Any]:
    return manifests.endpoint_manifest("bad", role=role, engine_id="e")


def _set(path: str, value: Any) -> Mutate:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
_MIXED = [*manifests.regions(2), *manifests.regions(1, mem_type="DRAM")]
_MIXED[2]["name"] = "model.layers.9.self_attn.attn"
_DUP = manifests.regions(2)
_DUP[1]["name"] = _DUP[0]["name"]

# (id, plural, role, mutation, text the message must contain)
CASES: list[tuple[str, str, str, Mutate, str]] = [
    # -- CRD schema: types, enums, bounds, patterns, required fields
    ("role-enum", ENDPOINTS, "decode", _set("spec.role", "router"), "spec.role"),
    ("tp-size-min", ENDPOINTS, "decode", _set("spec.tpSize", 0), "spec.tpSize"),
    ("port-max", ENDPOINTS, "decode", _set("spec.sideChannel.port", 70000),
     "spec.sideChannel.port"),
    ("geometry-required", ENDPOINTS, "decode", _set("spec.geometry", _DELETE), "spec.geometry"),
    ("hash-pattern", ENDPOINTS, "decode", _set("spec.compatibilityHash", "xyz"),
     "spec.compatibilityHash"),
    ("memtype-enum", ENDPOINTS, "decode", _set("spec.geometry.regions.0.memType", "HBM"),
     "spec.geometry.regions.memType: Unsupported value"),  # 1.20 omits the index
    ("regions-min", ENDPOINTS, "decode", _set("spec.geometry.regions", []),
     "spec.geometry.regions"),
    ("group-id-min", ENDPOINTS, "decode", _set("spec.geometry.regions.0.groupId", -2),
     "spec.geometry.regions.groupId"),
    ("epoch-type", ENDPOINTS, "decode", _set("spec.epoch", "one"), "spec.epoch"),
    ("mode-enum", ENDPOINTS, "decode", _set("spec.mode", "pushpull"), "spec.mode"),
    ("layout-pattern", ENDPOINTS, "decode", _set("spec.geometry.kvCacheLayout", "hnd"),
     "spec.geometry.kvCacheLayout"),
    ("block-len-min", ENDPOINTS, "decode", _set("spec.geometry.regions.0.blockLen", 0),
     "spec.geometry.regions.blockLen"),
    ("policy-enum", TRANSFERS, "", _set("spec.pairing", {"policy": "Random"}),
     "spec.pairing.policy"),
    ("decode-tp-min", TRANSFERS, "", _set("spec.decode.tensorParallelSize", 0),
     "spec.decode.tensorParallelSize"),
    ("prefill-required", TRANSFERS, "", _set("spec.prefill", _DELETE), "spec.prefill"),
    # -- admission webhook: cross-field rules
    ("protocol-version", ENDPOINTS, "decode", _set("spec.protocolVersion", 10),
     "spec.protocolVersion: expected 11"),
    ("tp-rank-below-size", ENDPOINTS, "decode", _set("spec.tpRank", 1),
     "spec.tpRank: expected a rank below spec.tpSize (1), got 1"),
    ("duplicate-region-name", ENDPOINTS, "decode", _set("spec.geometry.regions", _DUP),
     "spec.geometry.regions[1].name"),
    ("stride-below-len", ENDPOINTS, "decode", _set("spec.geometry.regions.0.blockStride", 100),
     "spec.geometry.regions[0].blockStride: expected >= spec.geometry.regions[0].blockLen "
     "(4096), got 100"),
    ("push-mixed-memory", ENDPOINTS, "decode",
     lambda b: (_set("spec.mode", "push")(b), _set("spec.geometry.regions", _MIXED)(b)),
     "spec.geometry.regions[*].memType: expected one memory type in push mode"),
    ("pull-mixed-producer", ENDPOINTS, "prefill", _set("spec.geometry.regions", _MIXED),
     "mixed-memory producer"),
    ("mixed-needs-mla", ENDPOINTS, "decode",
     lambda b: (_set("spec.geometry.regions", _MIXED)(b), _set("spec.geometry.isMla", False)(b)),
     "spec.geometry.isMla: true"),
    ("transfer-protocol", TRANSFERS, "", _set("spec.protocolVersion", 12),
     "spec.protocolVersion: expected 11"),
    ("topology-key-required", TRANSFERS, "", _set("spec.pairing", {"policy": "TopologyAware"}),
     "spec.pairing.topologyKey: required by policy TopologyAware"),
    ("topology-key-format", TRANSFERS, "",
     _set("spec.pairing", {"policy": "TopologyAware", "topologyKey": "bad key!"}),
     "spec.pairing.topologyKey: expected a label key"),
    ("tp-sizes-divide", TRANSFERS, "",
     lambda b: (_set("spec.prefill.tensorParallelSize", 3)(b),
                _set("spec.decode.tensorParallelSize", 2)(b)),
     "spec.decode.tensorParallelSize: expected a multiple or divisor"),
    ("expected-block-size", TRANSFERS, "",
     lambda b: (_set("spec.prefill.expectedGeometry", {"blockSize": 16})(b),
                _set("spec.decode.expectedGeometry", {"blockSize": 24})(b)),
     "spec.decode.expectedGeometry.blockSize: expected a multiple of"),
    ("selector-values", TRANSFERS, "",
     _set("spec.prefill.selector", {"matchExpressions": [{"key": "a", "operator": "In"}]}),
     "spec.prefill.selector.matchExpressions[0].values"),
    # -- Kubernetes' own syntax for what names Kubernetes things (schema, else webhook)
    ("selector-label-key", TRANSFERS, "",
     _set("spec.decode.selector", {"matchLabels": {"app/ x": "decode"}}),
     "spec.decode.selector.matchLabels['app/ x']: expected a label key"),
    ("selector-label-value", TRANSFERS, "",
     _set("spec.decode.selector", {"matchLabels": {"app": "de code"}}),
     "spec.decode.selector.matchLabels.app in body should match"),
    ("selector-expression-key", TRANSFERS, "",
     _set("spec.prefill.selector", {"matchExpressions": [
         {"key": "-bad", "operator": "Exists"}]}),
     "spec.prefill.selector.matchExpressions[0].key: expected a label key"),
    ("selector-expression-value", TRANSFERS, "",
     _set("spec.prefill.selector", {"matchExpressions": [
         {"key": "zone", "operator": "In", "values": ["a", "x" * 64]}]}),
     "spec.prefill.selector.matchExpressions.values in body should be at most 63"),
    ("host-with-port", ENDPOINTS, "decode", _set("spec.sideChannel.host", "10.0.3.7:5600"),
     "spec.sideChannel.host: expected an IP address or a DNS name without a port"),
    ("pod-name-syntax", ENDPOINTS, "decode", _set("spec.podName", "Decode_0"),
     "spec.podName in body should match"),
    ("transfer-name-syntax", ENDPOINTS, "decode", _set("spec.transferName", "my transfer"),
     "spec.transferName in body should match"),
]  # fmt: skip


@pytest.fixture(scope="module")
def bad_ns(api: Api, operator: Any) -> Iterator[str]:
    name = f"admission-{uuid.uuid4().hex[:5]}"
    api.core.create_namespace({"metadata": {"name": name}})
    yield name
    api.core.delete_namespace(name)


def _rejection(api: Api, ns: str, plural: str, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as info:
        api.create(plural, ns, body)
    assert info.value.status in (400, 422), info.value.body
    return json.loads(info.value.body)["message"]


@pytest.mark.parametrize(("plural", "role", "mutate", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_malformed_manifest_is_rejected_naming_the_field(
    api: Api, bad_ns: str, plural: str, role: str, mutate: Mutate, expected: str
) -> None:
    body = _ep(role) if plural == ENDPOINTS else manifests.transfer_manifest("bad")
    body = copy.deepcopy(body)
    mutate(body)
    message = _rejection(api, bad_ns, plural, body)
    assert expected in message


def test_update_rules_immutable_identity_and_growing_epoch(api: Api, bad_ns: str) -> None:
    api.create(ENDPOINTS, bad_ns, manifests.endpoint_manifest("upd", role="decode",
                                                              engine_id="e", epoch=5))  # fmt: skip
    for patch, expected in (
        ({"spec": {"role": "prefill"}}, "spec.role: field is immutable (was 'decode'"),
        ({"spec": {"epoch": 3}}, "spec.epoch: expected a value >= the current epoch 5, got 3"),
    ):
        with pytest.raises(ApiException) as info:
            api.patch(ENDPOINTS, bad_ns, "upd", patch)
        assert expected in json.loads(info.value.body)["message"]
    api.patch(ENDPOINTS, bad_ns, "upd", {"spec": {"epoch": 6}})  # growing epochs are fine


def test_kubectl_apply_shows_the_field(cluster: Any, bad_ns: str) -> None:
    body = manifests.endpoint_manifest("viakubectl", role="decode", engine_id="e", tpRank=3)
    result = cluster.kubectl("apply", "-n", bad_ns, "-f", "-", input=json.dumps(body),
                             check=False)  # fmt: skip
    assert result.returncode != 0
    assert "denied the request: spec.tpRank: expected a rank below spec.tpSize" in result.stderr


def test_explain_documents_every_field(cluster: Any) -> None:
    out = cluster.kubectl("explain", "kvtransfer.spec.pairing.policy").stdout
    assert "TopologyAware first prefers prefill engines" in out
    out = cluster.kubectl("explain", "kve.status.handshakes", "--recursive").stdout
    assert "peer" in out and "epoch" in out


def test_empty_strings_are_strings_not_null(api: Api, bad_ns: str) -> None:
    """"" in a custom-resource string field is accepted on create and on merge patch.

    The test apiserver's build fixes go-openapi's zero-value check (hack/test-stack.sh); an
    unpatched v1.20.2 built with Go >= 1.16 answers 'must be of type string: "null"'.
    """
    body = manifests.endpoint_manifest("empty", role="decode", engine_id="e", nodeName="")
    assert api.create(ENDPOINTS, bad_ns, body)["spec"]["nodeName"] == ""
    assert api.patch(ENDPOINTS, bad_ns, "empty", {"spec": {"podUID": ""}})["spec"]["podUID"] == ""
    entry = {**manifests.handshake("p0-0", 1, ok=False), "message": ""}
    status = api.patch_status(ENDPOINTS, bad_ns, "empty", {"handshakes": [entry]})["status"]
    assert status["handshakes"][0]["message"] == ""
