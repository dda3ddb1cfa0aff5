"""validate_remote: every rule of spec §1.6 / §10.11 fails with a message naming both values."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvbridge_agent.protocol import (
    EngineGeometry,
    IncompatibleGeometryError,
    NixlAgentMetadata,
    RegionGeometry,
    Rule,
    ValidationOptions,
    validate_remote,
)

NAMES = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn")

MLA = EngineGeometry(
    engine_id="prefill-0",
    tp_size=2,
    block_size=64,
    num_blocks=1000,
    block_lens=(1152,) * 4,
    block_strides=(1152,) * 4,
    kv_cache_layout="HND",
    attn_backend_name="FLASHMLA",
    region_num_blocks=(1000, 1000, 500, 500),
    region_group_ids=(0, 0, 1, 1),
    region_names=NAMES,
    region_mem_types=("VRAM",) * 4,
    is_mla=True,
    num_kv_heads=1,
    compatibility_hash="a" * 64,
    transfer_mode="pull",
)
# Full attention, 8 KV heads, TP 2 -> 4 heads per rank, 512 bytes per head per block.
GQA = replace(
    MLA,
    is_mla=False,
    num_kv_heads=8,
    block_size=16,
    block_lens=(2048,) * 4,
    block_strides=(2048,) * 4,
    region_group_ids=(0,) * 4,
    attn_backend_name="FLASH_ATTN",
)


def check(local: EngineGeometry, remote: EngineGeometry, **kw: Any) -> list[str]:
    verdict = validate_remote(local, remote, **kw)
    return [p.message for p in verdict.problems]


def only(local: EngineGeometry, remote: EngineGeometry, rule: Rule, **kw: Any):
    verdict = validate_remote(local, remote, **kw)
    assert not verdict.ok
    assert verdict.rules == {rule}, verdict.summary()
    return verdict.problems


def test_identical_engines_are_compatible() -> None:
    for geom in (MLA, GQA):
        verdict = validate_remote(
            geom,
            geom,
            expected_engine_id="prefill-0",
            expected_tp_size=2,
            expected_dcp_size=1,
            expected_num_blocks=1000,
        )
        assert verdict.ok and verdict.summary() == "compatible"
        verdict.raise_for_problems()


def test_region_names_differ_lists_each_index() -> None:
    remote = replace(MLA, region_names=(*NAMES[:3], "model.layers.4.attn"))
    (p,) = only(MLA, remote, Rule.REGION_NAMES)
    assert p.field == "region_names[3]"
    assert p.local == "model.layers.3.attn" and p.remote == "model.layers.4.attn"
    assert p.message.startswith(
        "region_names[3]: local 'model.layers.3.attn' != remote 'model.layers.4.attn'"
    )
    assert "same model caches in the same order" in p.message
    swapped = replace(MLA, region_names=(NAMES[1], NAMES[0], *NAMES[2:]))
    assert [q.field for q in only(MLA, swapped, Rule.REGION_NAMES)] == [
        "region_names[0]",
        "region_names[1]",
    ]


def test_all_problems_are_listed_and_raise_carries_the_verdict() -> None:
    remote = replace(
        MLA,
        engine_id="x",
        block_strides=(1152, 1000, 1152, 1152),
        region_names=(*NAMES[:3], "z"),
        protocol_version=10,
    )
    verdict = validate_remote(MLA, remote, expected_engine_id="prefill-0")
    assert verdict.rules == {
        Rule.ENGINE_ID,
        Rule.BLOCK_STRIDES,
        Rule.REGION_NAMES,
        Rule.PROTOCOL_VERSION,
    }
    with pytest.raises(IncompatibleGeometryError) as err:
        verdict.raise_for_problems()
    assert err.value.verdict is verdict
    assert str(err.value).startswith("4 incompatibilities: ")
    assert {d["rule"] for d in verdict.to_dicts()} == {str(r) for r in verdict.rules}


CASES: list[tuple[str, EngineGeometry, EngineGeometry, dict, Rule, str, str]] = [
    (
        "protocol",
        MLA,
        replace(MLA, protocol_version=10),
        {},
        Rule.PROTOCOL_VERSION,
        "protocol_version",
        "expected 11 (the NIXL connector version kvbridge speaks), got 10: the wire format "
        "and the descriptor math differ between versions (remote engine)",
    ),
    (
        "hash",
        MLA,
        replace(MLA, compatibility_hash="b" * 64),
        {},
        Rule.COMPATIBILITY_HASH,
        "compatibility_hash",
        "hash mismatch",
    ),
    (
        "mode",
        MLA,
        replace(MLA, transfer_mode="push"),
        {},
        Rule.TRANSFER_MODE,
        "transfer_mode",
        "local 'pull' != remote 'push'",
    ),
    (
        "engine-id",
        MLA,
        MLA,
        {"expected_engine_id": "prefill-9"},
        Rule.ENGINE_ID,
        "engine_id",
        "local 'prefill-9' != remote 'prefill-0': Remote NIXL agent engine ID mismatch",
    ),
    (
        "tp-expected",
        MLA,
        MLA,
        {"expected_tp_size": 4},
        Rule.TP_SIZE,
        "tp_size",
        "local 4 != remote 2",
    ),
    (
        "tp-divide",
        MLA,
        replace(MLA, tp_size=3),
        {},
        Rule.TP_SIZE,
        "tp_size",
        "tp_size: expected a multiple or divisor of the local tp_size (2), got 3: TP sizes are "
        "positive and divide one another",
    ),
    (
        "dcp-expected",
        MLA,
        MLA,
        {"expected_dcp_size": 2},
        Rule.DCP_SIZE,
        "dcp_size",
        "local 2 != remote 1",
    ),
    (
        "dcp-divide",
        replace(MLA, dcp_size=2),
        replace(MLA, dcp_size=3),
        {},
        Rule.DCP_SIZE,
        "dcp_size",
        "expected a multiple or divisor of the local dcp_size (2), got 3: DCP sizes",
    ),
    (
        "dcp-mla-mamba",
        replace(MLA, dcp_size=2, ssm_sizes=(8, 8)),
        replace(MLA, dcp_size=1, ssm_sizes=(8, 8)),
        {},
        Rule.DCP_SIZE,
        "dcp_size",
        "hybrid MLA+Mamba models require equal DCP sizes",
    ),
    (
        "pcp-divide",
        replace(MLA, pcp_size=2),
        replace(MLA, pcp_size=3),
        {},
        Rule.PCP_SIZE,
        "pcp_size",
        "expected a multiple or divisor of the local pcp_size (2), got 3: PCP sizes",
    ),
    (
        "replicated-heads",
        replace(GQA, tp_size=4, num_kv_heads=4, block_lens=(512,) * 4, block_strides=(512,) * 4),
        replace(GQA, tp_size=8, num_kv_heads=4, block_lens=(512,) * 4, block_strides=(512,) * 4),
        {},
        Rule.REPLICATED_KV_HEADS,
        "tp_size",
        "replicated KV heads (4 KV heads)",
    ),
    (
        "layout",
        GQA,
        replace(GQA, kv_cache_layout="NHD"),
        {},
        Rule.KV_CACHE_LAYOUT,
        "kv_cache_layout",
        "local 'HND' != remote 'NHD': non-MLA models need the same",
    ),
    (
        "block-size-not-multiple",
        MLA,
        replace(MLA, block_size=48),
        {},
        Rule.BLOCK_SIZE,
        "block_size",
        "local 64 vs remote 48: the local kernel block size must be a positive multiple",
    ),
    (
        "block-size-ratio-below-1",
        MLA,
        replace(MLA, block_size=128),
        {},
        Rule.BLOCK_SIZE,
        "block_size",
        "block_size_ratio = local // remote >= 1",
    ),
    (
        "host-buffer-bsr",
        MLA,
        replace(MLA, block_size=32, block_lens=(576,) * 4, block_strides=(576,) * 4),
        {"options": ValidationOptions(host_buffer=True)},
        Rule.HOST_BUFFER,
        "block_size",
        "block_size_ratio != 1 is not supported with a host buffer",
    ),
    (
        "mamba-ppl",
        replace(MLA, is_mla=False, ssm_sizes=(8, 8), kv_cache_layout="HND"),
        replace(MLA, is_mla=False, ssm_sizes=(8, 8), physical_blocks_per_logical_kv_block=2),
        {},
        Rule.MAMBA,
        "physical_blocks_per_logical_kv_block",
        "same ppl",
    ),
    (
        "num-blocks",
        MLA,
        replace(MLA, num_blocks=999),
        {"expected_num_blocks": 1000},
        Rule.NUM_BLOCKS,
        "num_blocks",
        "local 1000 != remote 999",
    ),
    (
        "num-regions",
        MLA,
        replace(
            MLA,
            block_lens=(1152,) * 3,
            block_strides=(1152,) * 3,
            region_num_blocks=(1,) * 3,
            region_group_ids=(0, 0, 1),
            region_mem_types=("VRAM",) * 3,
            region_names=NAMES[:3],
        ),
        {},
        Rule.NUM_REGIONS,
        "len(block_lens)",
        "local 4 != remote 3: P and D must have the same number of transfer regions",
    ),
    (
        "base-addrs",
        MLA,
        replace(MLA, num_base_addrs=5),
        {},
        Rule.NUM_REGIONS,
        "len(kv_caches_base_addr)",
        "local 4 != remote 5",
    ),
    (
        "mla-block-lens",
        MLA,
        replace(MLA, block_lens=(1152, 1152, 1024, 1152)),
        {},
        Rule.BLOCK_LENS,
        "block_lens[2]",
        "local 1152 != remote 1024: replicated region",
    ),
    (
        "mla-block-lens-bsr",
        MLA,
        replace(MLA, block_size=32),
        {},
        Rule.BLOCK_LENS,
        "block_lens[0]",
        "local 1152 != remote 1152: replicated region: local block_len // block_size_ratio (2)",
    ),
    (
        "split-block-lens",
        GQA,
        replace(GQA, block_lens=(2048, 2048, 2048, 1024)),
        {},
        Rule.BLOCK_LENS,
        "block_lens[3]",
        "local 2048 != remote 1024: split region",
    ),
    (
        "split-p-gt-d-bsr",
        GQA,
        replace(GQA, tp_size=4, block_size=8, block_lens=(512,) * 4),
        {},
        Rule.BLOCK_LENS,
        "block_size",
        "P TP > D TP need equal kernel block sizes",
    ),
    (
        "mla-mamba-lens",
        replace(MLA, ssm_sizes=(8, 8)),
        replace(MLA, ssm_sizes=(8, 8), block_lens=(1152, 1152, 1152, 576)),
        {},
        Rule.BLOCK_LENS,
        "block_lens[3]",
        "hybrid MLA+SSM",
    ),
    (
        "strides-len",
        MLA,
        replace(MLA, block_strides=(1152,) * 3),
        {},
        Rule.BLOCK_STRIDES,
        "len(block_strides)",
        "expected 4 (one entry per region), got 3: every per-region list has one entry",
    ),
    (
        "stride-lt-len",
        MLA,
        replace(MLA, block_strides=(1152, 1152, 1100, 1152)),
        {},
        Rule.BLOCK_STRIDES,
        "block_strides[2]",
        "expected >= block_lens[2] (1152), got 1100: a block stride must cover its block",
    ),
    (
        "region-num-blocks-len",
        MLA,
        replace(MLA, region_num_blocks=(1, 2)),
        {},
        Rule.REGION_NUM_BLOCKS,
        "len(region_num_blocks)",
        "expected 4 (one entry per region), got 2",
    ),
    (
        "region-group-ids-len",
        MLA,
        replace(MLA, region_group_ids=(0, 0, 1)),
        {},
        Rule.REGION_GROUP_IDS,
        "len(region_group_ids)",
        "expected 4 (one entry per region), got 3",
    ),
    (
        "region-mem-types-len",
        MLA,
        replace(MLA, region_mem_types=("VRAM",)),
        {},
        Rule.REGION_MEM_TYPES,
        "len(region_mem_types)",
        "expected 4 (one entry per region), got 1",
    ),
    (
        "region-names-len",
        MLA,
        replace(MLA, region_names=NAMES[:3]),
        {},
        Rule.REGION_NAMES,
        "len(region_names)",
        "expected 4 (one entry per region), got 3",
    ),
    (
        "mixed-producer-pull",
        MLA,
        replace(MLA, region_mem_types=("VRAM", "VRAM", "DRAM", "DRAM")),
        {},
        Rule.MIXED_MEMORY,
        "region_mem_types",
        "expected one memory type on a pull-mode producer, got ['DRAM', 'VRAM']: NIXL pull "
        "does not yet support a mixed-memory producer (remote engine)",
    ),
    (
        "mixed-push-local",
        replace(MLA, region_mem_types=("VRAM", "VRAM", "DRAM", "DRAM"), transfer_mode=None),
        replace(MLA, transfer_mode=None),
        {"mode": "push"},
        Rule.MIXED_MEMORY,
        "region_mem_types",
        "NixlPushConnector does not support mixed-memory KV caches",
    ),
    (
        "mixed-not-mla",
        replace(GQA, region_mem_types=("DRAM", "VRAM", "VRAM", "VRAM")),
        GQA,
        {},
        Rule.MAMBA,
        "region_mem_types",
        "only supported for MLA models without Mamba",
    ),
    (
        "push-groups",
        replace(MLA, transfer_mode="push"),
        replace(MLA, transfer_mode="push", region_group_ids=(0, 1, 1, 1)),
        {"mode": "push"},
        Rule.PUSH_GROUP_LAYOUT,
        "region_group_ids",
        "expected the producer's layout [0, 1, 1, 1], got [0, 0, 1, 1]: "
        "NixlPushConnector does not support different producer and consumer cache-group layouts",
    ),
    (
        "region-mapped-not-mla",
        GQA,
        replace(GQA, region_group_ids=(0, 0, 1, 1)),
        {},
        Rule.REGION_MAPPED,
        "region_group_ids",
        "require a pure MLA model",
    ),
    (
        "region-mapped-k",
        MLA,
        replace(
            MLA,
            block_size=32,
            block_lens=(576,) * 4,
            block_strides=(576,) * 4,
            region_group_ids=(0, 1, 1, 1),
        ),
        {},
        Rule.REGION_MAPPED,
        "region_group_ids",
        "equal kernel block sizes (block_size_ratio is 2)",
    ),
    (
        "region-mapped-mamba",
        replace(MLA, ssm_sizes=(8, 8)),
        replace(MLA, ssm_sizes=(8, 8), region_group_ids=(0, 1, 1, 1)),
        {},
        Rule.REGION_MAPPED,
        "region_group_ids",
        "no Mamba layers",
    ),
]


@pytest.mark.parametrize(
    ("local", "remote", "kw", "rule", "field", "text"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_each_rule_fails_with_its_message(
    local: EngineGeometry, remote: EngineGeometry, kw: dict, rule: Rule, field: str, text: str
) -> None:
    problems = only(local, remote, rule, **kw)
    assert field in [p.field for p in problems]
    assert any(text in p.message for p in problems), [p.message for p in problems]
    assert all(p.message.startswith(p.field + ": ") for p in problems)


def test_hash_check_switchable() -> None:
    remote = replace(MLA, compatibility_hash="b" * 64)
    opts = ValidationOptions(enforce_handshake_compat=False)
    assert validate_remote(MLA, remote, options=opts).ok


def test_permuted_layout_is_allowed_when_enabled() -> None:
    local, remote = replace(GQA, kv_cache_layout="LBNHC"), replace(GQA, kv_cache_layout="LBHNC")
    assert not validate_remote(local, remote).ok
    opts = ValidationOptions(enable_permute_local_kv=True)
    assert validate_remote(local, remote, options=opts).ok


def test_supported_heterogeneous_setups_pass() -> None:
    # MLA with k = 2 (remote kernel blocks half as big) and equal group layouts.
    assert validate_remote(
        MLA, replace(MLA, block_size=32, block_lens=(576,) * 4, block_strides=(576,) * 4)
    ).ok
    # D TP 4 reads a head slice from P TP 2: P blocks hold twice the heads.
    d4 = replace(GQA, tp_size=4, block_lens=(1024,) * 4, block_strides=(1024,) * 4)
    assert validate_remote(d4, GQA).ok
    # P TP 4 > D TP 2, no replication: P blocks hold half the heads.
    p4 = replace(GQA, tp_size=4, block_lens=(1024,) * 4, block_strides=(1024,) * 4)
    assert validate_remote(GQA, p4).ok
    # Heads unknown: scale by TP.
    assert validate_remote(replace(d4, num_kv_heads=None), replace(GQA, num_kv_heads=None)).ok
    # Pure MLA region-mapped reads with k == 1 (different group layouts) are fine in pull.
    assert validate_remote(MLA, replace(MLA, region_group_ids=(0, 1, 1, 1))).ok
    # Mixed memory on the consumer side of a pure MLA pull is fine.
    assert validate_remote(replace(MLA, region_mem_types=("DRAM", "VRAM", "VRAM", "VRAM")), MLA).ok


def test_v10_remote_falls_back_to_local_groups_and_type() -> None:
    v10 = replace(
        MLA, region_num_blocks=None, region_group_ids=None, region_names=None, region_mem_types=None
    )
    assert validate_remote(MLA, v10).ok
    # A v10 peer is assumed to have the local type; a DRAM-only local does not make it mixed.
    dram = replace(MLA, region_mem_types=("DRAM",) * 4)
    assert validate_remote(dram, v10).ok


def test_from_metadata_and_from_regions_agree() -> None:
    meta = NixlAgentMetadata(
        engine_id="prefill-0",
        agent_metadata=b"",
        kv_caches_base_addr=[0x1000 * i for i in range(4)],
        device_id=0,
        num_blocks=1000,
        block_lens=[1152] * 4,
        block_strides=[1152] * 4,
        kv_cache_layout="HND",
        block_size=64,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASHMLA",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[1000, 1000, 500, 500],
        region_group_ids=[0, 0, 1, 1],
        region_names=list(NAMES),
        region_mem_types=["VRAM"] * 4,
    )
    g = EngineGeometry.from_metadata(
        meta,
        tp_size=2,
        is_mla=True,
        num_kv_heads=1,
        compatibility_hash="a" * 64,
        transfer_mode="pull",
    )
    assert g == MLA and g.num_base_addrs == 4
    regions = [
        RegionGeometry(n, nb, gid, "VRAM", 1152, 1152)
        for n, nb, gid in zip(NAMES, (1000, 1000, 500, 500), (0, 0, 1, 1), strict=True)
    ]
    engine = dict(
        engine_id="prefill-0",
        tp_size=2,
        block_size=64,
        num_blocks=1000,
        kv_cache_layout="HND",
        attn_backend_name="FLASHMLA",
        is_mla=True,
        num_kv_heads=1,
        compatibility_hash="a" * 64,
        transfer_mode="pull",
    )
    assert EngineGeometry.from_regions(regions, **engine) == MLA
    spec = {
        "engineId": "prefill-0",
        "tpSize": 2,
        "tpRank": 0,
        "blockSize": 64,
        "numBlocks": 1000,
        "physicalBlocksPerLogical": 1,
        "layout": "HND",
        "attentionBackend": "FLASHMLA",
        "dcpSize": 1,
        "pcpSize": 1,
        "protocolVersion": 11,
        "compatibilityHash": "a" * 64,
        "transferMode": "pull",
        "isMla": True,
        "numKvHeads": 1,
        "regions": [
            {
                "name": r.name,
                "numBlocks": r.num_blocks,
                "groupId": r.group_id,
                "memType": r.mem_type,
                "blockLen": r.block_len,
                "blockStride": r.block_stride,
            }
            for r in regions
        ],
    }
    assert EngineGeometry.from_dict(spec) == MLA


def test_from_dict_errors_name_the_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['blok_size'\]"):
        EngineGeometry.from_dict({"blok_size": 1})
    with pytest.raises(ValueError, match=r"missing required keys .*'engine_id'"):
        EngineGeometry.from_dict({"tp_size": 1}, strict=False)
    with pytest.raises(ValueError, match=r"geometry.regions: .*missing \['block_stride'\]"):
        EngineGeometry.from_dict(
            {
                "engine_id": "e",
                "tp_size": 1,
                "block_size": 16,
                "num_blocks": 1,
                "layout": "HND",
                "regions": [
                    {"name": "a", "numBlocks": 1, "groupId": 0, "memType": "VRAM", "blockLen": 1}
                ],
            }
        )


def test_summary_limit() -> None:
    remote = replace(MLA, region_names=tuple(n + "x" for n in NAMES))
    verdict = validate_remote(MLA, remote)
    assert len(verdict.problems) == 4
    assert verdict.summary(limit=1).endswith("; ... and 3 more")
