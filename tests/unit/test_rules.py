"""The rule table: every rule fires with its one message, a valid engine passes them all, and
a caller's vocabulary renames every field a message mentions."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbridge_agent import rules
from kvbridge_agent.protocol import Rule

LISTS = {
    "block_lens": [1152, 1152],
    "block_strides": [1152, 2304],
    "region_num_blocks": [16, 16],
    "region_group_ids": [0, -1],
    "region_names": ["model.layers.0.attn", "model.layers.1.attn"],
    "region_mem_types": ["VRAM", "DRAM"],
}


def _regions(**change: object) -> list[rules.Finding]:
    lists = {**LISTS, **change}
    return rules.check_regions(len(lists["block_lens"]), lists)  # type: ignore[arg-type]


Trigger = Callable[[], "list[rules.Finding | None] | rules.Finding | None"]

# (rule id, a call that breaks it, the field named, words of "expected ..., got ...")
CASES: list[tuple[str, Trigger, str, str]] = [
    ("protocol_version", lambda: rules.protocol_version(10), "protocol_version",
     "expected 11 (the NIXL connector version kvbridge speaks), got 10"),
    ("tp_rank", lambda: rules.tp_rank(2, 2), "tp_rank", "expected a rank below tp_size (2), got 2"),
    *((f"{k}_sizes_divide", lambda k=k: rules.sizes_divide(
        k, 3, 2, field=f"{k}_size", other_field=f"the local {k}_size"), f"{k}_size",
       f"expected a multiple or divisor of the local {k}_size (2), got 3")
      for k in ("tp", "dcp", "pcp")),
    ("engine_id", lambda: rules.check_engine("", {}), "engine_id",
     "expected a non-empty engine id, got ''"),
    ("positive_num_blocks", lambda: rules.check_engine("p", {"num_blocks": 0}), "num_blocks",
     "expected >= 1, got 0"),
    ("positive_block_size", lambda: rules.check_engine("p", {"block_size": 0}), "block_size",
     "expected >= 1, got 0"),
    ("positive_physical_blocks_per_logical_kv_block",
     lambda: rules.check_engine("p", {"physical_blocks_per_logical_kv_block": -1}),
     "physical_blocks_per_logical_kv_block", "expected >= 1, got -1"),
    ("num_regions", lambda: rules.check_regions(0, {}), "len(kv_caches_base_addr)",
     "expected >= 1, got 0"),
    *((f"len_{n}", lambda n=n: rules.check_lengths(2, {n: LISTS[n][:1]}), f"len({n})",
       "expected 2 (one entry per region), got 1") for n in rules.PER_REGION_LISTS),
    ("block_len", lambda: _regions(block_lens=[1152, 0]), "block_lens[1]",
     "expected >= 1, got 0"),
    ("block_stride", lambda: _regions(block_strides=[1000, 2304]), "block_strides[0]",
     "expected >= block_lens[0] (1152), got 1000"),
    ("region_capacity", lambda: _regions(region_num_blocks=[16, 0]), "region_num_blocks[1]",
     "expected >= 1, got 0"),
    ("group_id", lambda: _regions(region_group_ids=[0, -2]), "region_group_ids[1]",
     "expected >= -1 (a group, or -1 for shared), got -2"),
    ("mem_type", lambda: _regions(region_mem_types=["VRAM", "HBM"]), "region_mem_types[1]",
     "expected DRAM or VRAM, got 'HBM'"),
    ("region_name", lambda: _regions(region_names=["a", ""]), "region_names[1]",
     "expected a non-empty name, got ''"),
    ("unique_region_name", lambda: _regions(region_names=["a", "a"]), "region_names[1]",
     "expected a name unlike region_names[0], got 'a'"),
    ("push_single_memory",
     lambda: rules.single_memory(["VRAM", "DRAM"], mode="push", producer=False),
     "region_mem_types", "expected one memory type in push mode, got ['DRAM', 'VRAM']"),
    ("producer_single_memory",
     lambda: rules.single_memory(["VRAM", "DRAM"], mode="pull", producer=True),
     "region_mem_types", "expected one memory type on a pull-mode producer, got ['DRAM', 'VRAM']"),
    ("mixed_needs_mla", lambda: rules.mixed_needs_mla(["VRAM", "DRAM"], is_mla=False),
     "region_mem_types", "mixed types need is_mla: true and no Mamba layers"),
    ("push_group_layout", lambda: rules.push_group_layout([0, 1], [0, 0]), "region_group_ids",
     "expected the producer's layout [0, 1], got [0, 0]"),
]


def _findings(trigger: Trigger) -> list[rules.Finding]:
    got = trigger()
    return [f for f in (got if isinstance(got, list) else [got]) if f is not None]


@pytest.mark.parametrize(("rule_id", "trigger", "field", "words"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_each_rule_fires_with_its_message(rule_id: str, trigger: Trigger, field: str,
                                          words: str) -> None:  # fmt: skip
    (finding,) = _findings(trigger)
    rule = rules.RULES[rule_id]
    assert finding.rule is rule and finding.field == field
    assert field.split("[")[0] == rule.field  # the table names the field it checks
    assert finding.message == f"{field}: {finding.text}"
    assert finding.message.startswith(f"{field}: ") and words in finding.message
    assert finding.message.endswith(f": {rule.why}")


def test_every_rule_has_a_case_and_reports_under_a_verdict_rule() -> None:
    assert sorted(c[0] for c in CASES) == sorted(rules.RULES)
    for rule in rules.RULES.values():
        assert rule.reports == "tp_rank" or rule.reports in {str(r) for r in Rule}, rule


def test_a_valid_engine_passes_every_rule() -> None:
    assert rules.protocol_version(rules.NIXL_CONNECTOR_VERSION) is None
    assert rules.tp_rank(0, 1) is None and rules.tp_rank(3, 4) is None
    for size, other in ((1, 1), (2, 8), (8, 2), (4, 4)):
        assert rules.sizes_divide("tp", size, other, field="tp_size", other_field="x") is None
    assert rules.sizes_divide("dcp", 0, 2, field="dcp_size", other_field="x") is not None
    assert rules.check_engine("p", {"num_blocks": 1, "block_size": 16,
                                    "physical_blocks_per_logical_kv_block": 1}) == []
    assert _regions() == []
    assert rules.block_stride(64, 64) is None
    for mode in ("pull", "push"):
        for producer in (False, True):
            assert rules.single_memory(["VRAM", "VRAM"], mode=mode, producer=producer) is None
    # a mixed MLA consumer may pull; a v10 peer has no region lists to check
    assert rules.single_memory(["VRAM", "DRAM"], mode="pull", producer=False) is None
    assert rules.mixed_needs_mla(["VRAM", "DRAM"], is_mla=True) is None
    assert rules.check_regions(2, {"block_lens": [64, 64], "block_strides": [64, 64],
                                   "region_names": None}) == []
    assert rules.push_group_layout((0, 1), [0, 1]) is None


def test_mamba_layers_forbid_mixed_memory_even_for_mla() -> None:
    (finding,) = _findings(lambda: rules.mixed_needs_mla(["VRAM", "DRAM"], is_mla=True,
                                                         mamba=True))
    assert finding.rule.id == "mixed_needs_mla"


def test_a_vocabulary_renames_every_field_a_message_mentions() -> None:
    paths = {"block_strides[0]": "spec.geometry.regions[0].blockStride",
             "block_lens[0]": "spec.geometry.regions[0].blockLen",
             "tp_rank": "spec.tpRank", "tp_size": "spec.tpSize",
             "region_mem_types": "spec.geometry.regions[*].memType",
             "is_mla": "spec.geometry.isMla"}
    (stride,) = rules.check_strides([64], [32], name=paths.__getitem__)
    assert stride.message.startswith(
        "spec.geometry.regions[0].blockStride: expected >= spec.geometry.regions[0].blockLen "
        "(64), got 32: ")
    rank = rules.tp_rank(1, 1, name=paths.__getitem__)
    assert rank is not None and rank.message.startswith(
        "spec.tpRank: expected a rank below spec.tpSize (1), got 1")
    mla = rules.mixed_needs_mla(["DRAM", "VRAM"], is_mla=False, name=paths.__getitem__)
    assert mla is not None and "(mixed types need spec.geometry.isMla: true" in mla.message
    assert mla.field == "spec.geometry.regions[*].memType"


def test_a_note_says_where_after_the_why() -> None:
    f = rules.protocol_version(10, note="remote engine")
    assert f is not None and f.message.endswith(f": {f.rule.why} (remote engine)")


def test_the_region_lists_are_the_wire_order() -> None:
    from kvbridge_agent.protocol import NixlAgentMetadata

    wire = [n for n in NixlAgentMetadata.__struct_fields__ if n in rules.PER_REGION_LISTS]
    assert tuple(wire) == rules.PER_REGION_LISTS
