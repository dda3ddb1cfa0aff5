"""The KVEndpoint field table: the agent's document parses back into the operator's record,
field for field, and every wire field the table names maps to its KVEndpoint path."""

from __future__ import annotations

from kvbridge_agent.resources import (
    ENDPOINT_FIELDS,
    GEOMETRY_FIELDS,
    REGION_FIELDS,
    endpoint_document,
    endpoint_path,
)
from kvbridge_operator.spec import parse_endpoint

SPEC = {
    "role": "decode", "transfer": "kvt", "engine_id": "d", "pod_name": "d-0", "pod_uid": "u",
    "node_name": "n", "host": "10.0.0.1", "port": 5600, "tp_rank": 1, "tp_size": 2,
    "dp_index": 0, "protocol_version": 11, "compatibility_hash": "ab" * 32, "mode": "pull",
    "epoch": 7, "serving_port": 8000, "kv_events_port": 5557,
    "model_name": "tiny-llama", "model_revision": "3f2a9c1",
    "model_fingerprint": "sampled-v1:" + "cd" * 32, "vllm_version": "0.30.0",
    "kvbridge_version": "0.1.0",
}
GEOMETRY = {
    "block_size": 16, "physical_blocks_per_logical": 1, "num_blocks": 64,
    "kv_cache_layout": "HND", "attention_backend": "FLASH_ATTN", "is_mla": False,
    "num_kv_heads": None, "dcp_size": 1, "pcp_size": 1,
}
REGIONS = [{"name": "l0", "num_blocks": 64, "group_id": 0, "mem_type": "DRAM",
            "block_len": 4096, "block_stride": 4096}]


def test_document_parses_back_field_for_field() -> None:
    doc = endpoint_document(SPEC, GEOMETRY, REGIONS)
    assert doc["sideChannel"] == {"host": "10.0.0.1", "port": 5600}
    assert doc["servingPort"] == 8000 and doc["kvEventsPort"] == 5557
    assert "numKvHeads" not in doc["geometry"]
    ep = parse_endpoint({"metadata": {"name": "d-0"}, "spec": doc})
    assert {f.attr: getattr(ep, f.attr) for f in ENDPOINT_FIELDS} == SPEC
    assert {f.attr: getattr(ep.geometry, f.attr) for f in GEOMETRY_FIELDS} == GEOMETRY
    assert [{f.attr: getattr(r, f.attr) for f in REGION_FIELDS}
            for r in ep.geometry.regions] == REGIONS


def test_empty_optional_fields_are_left_out() -> None:
    doc = endpoint_document({**SPEC, "pod_uid": "", "node_name": "", "serving_port": 0},
                            GEOMETRY, REGIONS)
    assert not {"podUID", "nodeName", "servingPort"} & set(doc)
    ep = parse_endpoint({"spec": doc})
    assert (ep.pod_uid, ep.node_name, ep.serving_port) == ("", "", 0)


def test_an_endpoint_without_model_identity_parses_with_empty_identity() -> None:
    """Agents older than spec.model publish none: their endpoints still parse (and pair only
    with endpoints that state no fingerprint either)."""
    doc = endpoint_document({k: v for k, v in SPEC.items()
                             if not k.startswith(("model_", "vllm_", "kvbridge_"))},
                            GEOMETRY, REGIONS)
    assert "model" not in doc and "versions" not in doc
    ep = parse_endpoint({"spec": doc})
    assert (ep.model_name, ep.model_revision, ep.model_fingerprint) == ("", "", "")
    assert (ep.vllm_version, ep.kvbridge_version) == ("", "")


def test_wire_fields_name_their_kvendpoint_paths() -> None:
    assert endpoint_path("transfer_mode") == "spec.mode"
    assert endpoint_path("physical_blocks_per_logical_kv_block") == \
        "spec.geometry.physicalBlocksPerLogical"
    assert endpoint_path("attn_backend_name") == "spec.geometry.attentionBackend"
    assert endpoint_path("block_lens[2]") == "spec.geometry.regions[2].blockLen"
    assert endpoint_path("region_mem_types") == "spec.geometry.regions[*].memType"
    assert endpoint_path("len(block_lens)") == "spec.geometry.regions"
    assert endpoint_path("kv_caches_base_addr[1]") == "spec.geometry.regions[1]"
    assert endpoint_path("unknown_field") == "unknown_field"
