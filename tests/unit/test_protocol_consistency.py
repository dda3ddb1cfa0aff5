"""A peer's v11 metadata checked against itself (no local geometry): each inconsistency is
reported with its field, the expected and the found value."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge_agent.protocol import Rule, check_metadata, decode_metadata
from spec_vectors import load_vectors

VECTOR = load_vectors("v11-handshake.json")["examples"][0]


def _meta(**change):
    meta = decode_metadata(bytes.fromhex(VECTOR["metadata_msgpack_hex"]))
    return msgspec.structs.replace(meta, **change)


def test_the_spec_vector_is_consistent():
    assert check_metadata(_meta()).ok


@pytest.mark.parametrize(("change", "rule", "field", "words"), [
    ({"block_strides": [1152]}, Rule.BLOCK_STRIDES, "len(block_strides)",
     "expected 2 (one entry per region"),
    ({"region_mem_types": ["VRAM", "DRAM", "VRAM"]}, Rule.REGION_MEM_TYPES,
     "len(region_mem_types)", "got 3"),
    ({"region_names": ["model.layers.0.attn"]}, Rule.REGION_NAMES, "len(region_names)", "got 1"),
    ({"block_strides": [1152, 1000]}, Rule.BLOCK_STRIDES, "block_strides[1]",
     "expected >= block_lens[1] (1152), got 1000"),
    ({"region_num_blocks": [16, 0]}, Rule.REGION_NUM_BLOCKS, "region_num_blocks[1]",
     "expected >= 1, got 0"),
    ({"region_group_ids": [0, -2]}, Rule.REGION_GROUP_IDS, "region_group_ids[1]", "got -2"),
    ({"region_mem_types": ["VRAM", "HBM"]}, Rule.REGION_MEM_TYPES, "region_mem_types[1]",
     "expected DRAM or VRAM, got 'HBM'"),
    ({"region_names": ["a", "a"]}, Rule.REGION_NAMES, "region_names[1]",
     "a name unlike region_names[0]"),
    ({"block_lens": [1152, 0]}, Rule.BLOCK_LENS, "block_lens[1]", "expected >= 1, got 0"),
    ({"num_blocks": 0}, Rule.NUM_BLOCKS, "num_blocks", "expected >= 1, got 0"),
    ({"block_size": 0}, Rule.BLOCK_SIZE, "block_size", "got 0"),
    ({"engine_id": ""}, Rule.ENGINE_ID, "engine_id", "non-empty"),
    ({"kv_caches_base_addr": [], "block_lens": [], "block_strides": [],
      "region_num_blocks": [], "region_group_ids": [], "region_names": [],
      "region_mem_types": []}, Rule.NUM_REGIONS, "len(kv_caches_base_addr)", "got 0"),
])
def test_each_inconsistency_is_named(change, rule, field, words):
    verdict = check_metadata(_meta(**change))
    assert not verdict.ok
    (problem,) = [p for p in verdict.problems if p.field == field]
    assert problem.rule == rule
    assert problem.message.startswith(f"{field}: ") and words in problem.message


def test_a_v10_peer_without_region_lists_is_consistent():
    assert check_metadata(_meta(region_num_blocks=None, region_group_ids=None,
                                region_names=None, region_mem_types=None)).ok
