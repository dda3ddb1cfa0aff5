"""The fronts never send across model revisions (issue #35): the routing table skips a pair
whose engines publish different ``spec.model`` identities even when every status says it is
verified, and the endpoint picker's answers name the revision that served."""

from __future__ import annotations

import asyncio
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvbridge_router.balance import REVISION_HEADER
from kvbridge_router.extproc import EndpointPicker
from kvbridge_router.picker import PAIR_HEADER, PickerSettings
from kvbridge_router.table import RoutingTable, routing_table

T = "kvt"
TRANSFER = {"metadata": {"name": T}, "spec": {}}
OLD_FP, NEW_FP = "sampled-v1:" + "a" * 64, "sampled-v1:" + "b" * 64


def ep_doc(name: str, role: str, *, fingerprint: str = "", revision: str = "",
           peer: str = "") -> dict[str, Any]:  # fmt: skip
    """A KVEndpoint the operator paired (and, for a decode, verified with ``peer``)."""
    spec: dict[str, Any] = {"transferName": T, "role": role, "engineId": name, "epoch": 1,
                            "podName": name, "tpRank": 0, "tpSize": 1,
                            "sideChannel": {"host": f"10.0.0.{len(name)}", "port": 5600}}
    model = {k: v for k, v in (("fingerprint", fingerprint), ("revision", revision)) if v}
    if model:
        spec["model"] = {"name": "m", **model}
    status: dict[str, Any] = {"state": "Paired", "peers": [], "handshakes": []}
    if peer:
        status["peers"] = [{"name": peer, "epoch": 1}]
        status["handshakes"] = [{"peer": peer, "epoch": 1, "state": "Succeeded"}]
    return {"metadata": {"name": name}, "spec": spec, "status": status}


def test_a_pair_across_revisions_is_skipped_even_when_verified() -> None:
    table = routing_table(T, TRANSFER, [
        ep_doc("p-old", "prefill", fingerprint=OLD_FP, revision="r1"),
        ep_doc("p-new", "prefill", fingerprint=NEW_FP, revision="r2"),
        ep_doc("d-old", "decode", fingerprint=OLD_FP, revision="r1", peer="p-old"),
        ep_doc("d-cross", "decode", fingerprint=NEW_FP, revision="r2", peer="p-old"),
        ep_doc("d-rev", "decode", fingerprint=OLD_FP, revision="r2", peer="p-old"),
        ep_doc("d-new", "decode", fingerprint=NEW_FP, revision="r2", peer="p-new"),
    ])
    assert dict(table.pairs) == {"d-new": ("p-new",), "d-old": ("p-old",)}
    assert table.engines["d-old"].revision == "r1"
    assert table.engines["d-new"].model_fingerprint == NEW_FP


def test_identity_rules_and_labels() -> None:
    table = routing_table(T, TRANSFER, [
        ep_doc("p-legacy", "prefill"),
        ep_doc("d-legacy", "decode", peer="p-legacy"),             # neither states one: pairs
        ep_doc("p-fp", "prefill", fingerprint=NEW_FP),
        ep_doc("d-fp", "decode", fingerprint=NEW_FP, revision="r9", peer="p-fp"),  # one side
        ep_doc("d-none", "decode", peer="p-fp"),                   # a fingerprint vs none
    ])
    assert dict(table.pairs) == {"d-fp": ("p-fp",), "d-legacy": ("p-legacy",)}
    assert table.engines["d-legacy"].revision == "unknown"
    assert table.engines["p-fp"].revision == "b" * 12
    assert table.engines["d-fp"].revision == "r9"


async def _pick_and_answer(table: RoutingTable) -> dict[str, str]:
    """One request through the picker: its request headers, then the engine's response
    headers; the headers the picker sets on the response."""
    picker = EndpointPicker(lambda: table, PickerSettings())

    async def requests() -> Any:
        yield ep.ProcessingRequest(request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path",
                                                                     value="/v1/completions")]),
            end_of_stream=True))
        yield ep.ProcessingRequest(response_headers=ep.HttpHeaders())

    replies = [r async for r in picker.Process(requests(), None)]  # type: ignore[arg-type]
    mutation = replies[-1].response_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() or h.header.value
            for h in mutation.set_headers}


def test_the_picker_names_the_revision_that_served() -> None:
    table = routing_table(T, TRANSFER, [
        ep_doc("p-new", "prefill", fingerprint=NEW_FP, revision="r2"),
        ep_doc("d-new", "decode", fingerprint=NEW_FP, revision="r2", peer="p-new"),
    ])
    headers = asyncio.run(_pick_and_answer(table))
    assert headers[PAIR_HEADER] == "p-new->d-new"
    assert headers[REVISION_HEADER] == "r2"
