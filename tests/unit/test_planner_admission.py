"""Admission rules (pure): valid objects pass, each cross-field rule names its field."""

from __future__ import annotations

import pytest

from kvbridge_operator import admission
from kvbridge_operator import testing as T


def test_valid_objects_pass() -> None:
    assert admission.check_endpoint(T.endpoint_manifest("e", role="decode", engine_id="d")) == []
    assert admission.check_transfer(T.transfer_manifest()) == []
    mixed = [*T.regions(2), *T.regions(1, mem_type="DRAM")]
    mixed[2]["name"] = "model.layers.7.mlp"
    ok = T.endpoint_manifest("e", role="decode", engine_id="d", geometry={"regions": mixed})
    assert admission.check_endpoint(ok) == []  # a mixed MLA decode endpoint may pull


@pytest.mark.parametrize(("kw", "prefix"), [
    ({"protocolVersion": 10}, "spec.protocolVersion: expected 11"),
    ({"tp_rank": 2, "tp_size": 2}, "spec.tpRank: expected a rank below spec.tpSize (2)"),
    ({"geometry": {"regions": [{**T.regions(1)[0], "blockStride": 8}]}},
     "spec.geometry.regions[0].blockStride"),
])  # fmt: skip
def test_endpoint_rules(kw: dict, prefix: str) -> None:
    problems = admission.check_endpoint(T.endpoint_manifest("e", role="decode", engine_id="d",
                                                            **kw))  # fmt: skip
    assert len(problems) == 1 and problems[0].startswith(prefix)


def test_malformed_endpoint_reports_field_path() -> None:
    body = T.endpoint_manifest("e", role="decode", engine_id="d")
    body["spec"]["geometry"]["regions"][1]["blockLen"] = "big"
    assert admission.check_endpoint(body) == [
        "spec.geometry.regions[1].blockLen: expected type int, got 'big'"
    ]


def test_update_rules() -> None:
    old = T.endpoint_manifest("e", role="decode", engine_id="d", epoch=4)
    new = T.endpoint_manifest("e", role="decode", engine_id="other", epoch=3)
    problems = admission.check_endpoint(new, old)
    assert [p.split(":")[0] for p in problems] == ["spec.engineId", "spec.epoch"]


def test_transfer_rules() -> None:
    t = T.transfer_manifest(prefill_tp=3, decode_tp=2, pairing={"topologyKey": "zone"})
    problems = admission.check_transfer(t)
    assert [p.split(":")[0] for p in problems] == [
        "spec.decode.tensorParallelSize", "spec.pairing.topologyKey"
    ]  # fmt: skip
