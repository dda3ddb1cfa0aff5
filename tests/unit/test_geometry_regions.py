"""Region planning (spec §2.2–§2.6) and descriptor tables (§2.7), including the §6.1 tests."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_agent.geometry import (
    CacheView,
    CacheViewError,
    GeometryError,
    MemoryTypeConflictError,
    RegionAliasError,
    RegistrationRange,
    UnsupportedGeometryError,
    block_ids_by_region,
    local_descriptor_table,
    plan_regions,
    region_sort_key,
    remote_descriptor_table,
)


def view(name: str, addr: int, *, group: int = 0, n: int = 4, length: int = 16,
         stride: int | None = None, mem: str = "VRAM", mla: bool = True, dev: int = 0,
         reg: tuple[int, int] | None = None) -> CacheView:
    return CacheView(
        name=name, group_id=group, addr=addr, num_blocks=n, block_len=length,
        block_stride=stride if stride is not None else length, mem_type=mem, device_id=dev,
        reg_base=reg[0] if reg else None, reg_nbytes=reg[1] if reg else None, is_mla=mla,
    )


# -- §2.2 natural order ---------------------------------------------------------------------


def test_region_sort_key_natural_order() -> None:
    names = [
        "model.layers.61.self_attn.attn",
        "model.layers.10.self_attn.attn",
        "model.layers.2.self_attn.indexer.k_cache",
        "model.layers.2.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert sorted(names, key=region_sort_key) == [
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",
        "model.layers.2.self_attn.indexer.k_cache",
        "model.layers.10.self_attn.attn",
        "model.layers.61.self_attn.attn",
    ]


def test_region_sort_key_digit_run_before_text_run() -> None:
    assert region_sort_key("a1") < region_sort_key("ab")
    assert region_sort_key("layer2") < region_sort_key("layer10")
    assert region_sort_key("x.9.y") < region_sort_key("x.y")
    assert region_sort_key("") == ()


def test_plan_orders_regions_by_layer_name() -> None:
    plan = plan_regions([view("l.10", 4000), view("l.2", 2000), view("l.1", 1000)])
    assert plan.names == ("l.1", "l.2", "l.10")
    assert plan.addrs.tolist() == [1000, 2000, 4000]
    assert [r.index for r in plan.regions] == [0, 1, 2]


# -- §6.1 -----------------------------------------------------------------------------------


def test_local_descriptors_follow_each_region_pool_capacity() -> None:
    plan = plan_regions([view("l.0", 100, n=2), view("l.1", 1000, n=3)])
    table = local_descriptor_table(plan)
    assert table.dtype == np.uint64 and table.shape == (5, 3)
    assert table[:, 0].tolist() == [100, 116, 1000, 1016, 1032]
    assert table[:, 1].tolist() == [16] * 5
    assert plan.num_descs == 5 == table.shape[0]


def test_overlaid_transfer_groups_share_region_geometry() -> None:
    page, stride, n, base = 64, 128, 4, 0x10000
    backing = (base, n * stride)
    a = view("model.layers.0.attn", base, group=0, n=n, length=page, stride=stride, reg=backing)
    b = view("model.layers.0.attn_hs", base, group=1, n=n, length=page, stride=stride,
             reg=backing)
    plan = plan_regions([b, a])
    assert len(plan) == 1
    region = plan.regions[0]
    assert region.group_id == -1 and region.shared  # (a)
    assert region.block_stride == stride  # (b) backing stride, not the page
    assert plan.registrations == (RegistrationRange(base, n * stride, 0, "VRAM"),)  # (c)
    table = local_descriptor_table(plan)
    assert table[:, 0].tolist() == [base + i * stride for i in range(n)]  # (d)
    assert plan.group_ids.tolist() == [-1] and plan.region_num_blocks.tolist() == [4]  # (e)
    assert not plan.uses_group_mapping
    assert region.members == ("model.layers.0.attn", "model.layers.0.attn_hs")
    assert [x.tolist() for x in block_ids_by_region(([0], [2]), plan.group_ids)] == [[0, 2]]


# -- dedup, conflicts, flags ----------------------------------------------------------------


def test_identical_geometry_same_group_folds_and_keeps_group() -> None:
    plan = plan_regions([view("a", 0, group=2), view("b", 0, group=2)])
    assert len(plan) == 1 and plan.regions[0].group_id == 2 and plan.names == ("a",)


def test_mla_geometry_wins_capacity() -> None:
    plan = plan_regions([view("a", 0, n=2, mla=False), view("b", 0, n=4, mla=True)])
    assert plan.regions[0].num_blocks == 4 and plan.regions[0].is_mla
    plan = plan_regions([view("a", 0, n=4, mla=True), view("b", 0, n=2, mla=False)])
    assert plan.regions[0].num_blocks == 4 and plan.regions[0].is_mla


def test_same_base_different_memory_types_is_an_error() -> None:
    with pytest.raises(MemoryTypeConflictError, match=r"'a' \(VRAM\) and 'b' \(DRAM\)"):
        plan_regions([view("a", 4096), view("b", 4096, mem="DRAM")])


def test_same_base_different_block_len_is_an_alias_error() -> None:
    # The #57662 hazard: aliases of different block lengths must not fold silently.
    with pytest.raises(RegionAliasError, match=r"views 'a' .* and 'b' .* overlap"):
        plan_regions([view("a", 0, length=16, stride=32), view("b", 0, length=8, stride=32)])


def test_same_base_same_len_different_stride_is_an_alias_error() -> None:
    with pytest.raises(RegionAliasError, match=r"'a' and 'b' .*block_stride \(16 vs 32\)"):
        plan_regions([view("a", 0, stride=16), view("b", 0, stride=32)])


def test_partial_overlap_is_an_error() -> None:
    with pytest.raises(RegionAliasError, match=r"'a'.*'b'"):
        plan_regions([view("a", 0, n=4), view("b", 40, n=4)])


def test_interleaved_layers_do_not_overlap() -> None:
    # BLHNC-style: layers interleaved inside a block, stride = layers * len.
    views = [view(f"l.{i}", i * 16, n=8, length=16, stride=64) for i in range(4)]
    plan = plan_regions(views)
    assert len(plan) == 4
    table = local_descriptor_table(plan)
    starts = np.sort(table[:, 0].astype(np.int64))
    assert np.all(np.diff(starts) >= 16)  # no two descriptors overlap


def test_interleaved_with_different_strides_detects_collision() -> None:
    ok = [view("a", 0, n=4, length=8, stride=32), view("b", 8, n=2, length=8, stride=64)]
    assert len(plan_regions(ok)) == 2
    bad = [view("a", 0, n=4, length=8, stride=32), view("b", 60, n=2, length=8, stride=40)]
    with pytest.raises(RegionAliasError):  # b block 1 at [100,108) hits a block 3 at [96,104)
        plan_regions(bad)


def test_vram_on_different_devices_may_share_addresses() -> None:
    plan = plan_regions([view("a", 0, dev=0), view("b", 0, dev=1)])
    assert plan.device_ids.tolist() == [0, 1]


def test_registrations_dedup_by_base_and_type_dram_first_on_device_0() -> None:
    views = [
        view("l.0", 0x1000, reg=(0x1000, 1024), dev=3),
        view("l.1", 0x1100, reg=(0x1000, 1024), dev=3),
        view("l.2", 0x9000, mem="DRAM", dev=5, reg=(0x9000, 64)),
    ]
    plan = plan_regions(views)
    assert plan.registrations == (
        RegistrationRange(0x9000, 64, 0, "DRAM"),
        RegistrationRange(0x1000, 1024, 3, "VRAM"),
    )
    assert plan.registrations_for("DRAM") == plan.registrations[:1]
    assert plan.regions[2].device_id == 0
    assert plan.mixed_mem_types and plan.mem_types == ("VRAM", "VRAM", "DRAM")


def test_registration_base_with_two_memory_types_is_an_error() -> None:
    with pytest.raises(MemoryTypeConflictError, match="registration base"):
        plan_regions([view("a", 0, reg=(0, 4096)), view("b", 1024, mem="DRAM", reg=(0, 4096))])


def test_mixed_memory_requires_mla() -> None:
    with pytest.raises(UnsupportedGeometryError, match=r"only supported for MLA.*'b'"):
        plan_regions([view("a", 0), view("b", 4096, mem="DRAM", mla=False)])
    assert issubclass(UnsupportedGeometryError, NotImplementedError)


def test_derived_flags() -> None:
    plan = plan_regions([view("a", 0, group=0), view("b", 4096, group=1)])
    assert plan.uses_group_mapping and not plan.mixed_mem_types
    assert plan.group_ids.dtype == np.int64 and plan.addrs.dtype == np.uint64
    with pytest.raises(ValueError):
        plan.group_ids[0] = 5  # read-only


def test_plan_errors() -> None:
    with pytest.raises(GeometryError, match="no KV cache views"):
        plan_regions([])
    with pytest.raises(GeometryError, match="'a' appears twice"):
        plan_regions([view("a", 0), view("a", 4096)])


# -- CacheView ------------------------------------------------------------------------------


def test_cache_view_field_errors_name_layer_and_field() -> None:
    with pytest.raises(CacheViewError, match=r"view 'x': block_stride: expected >= block_len"):
        view("x", 0, length=32, stride=16)
    with pytest.raises(CacheViewError, match=r"view 'x': mem_type: expected DRAM or VRAM, got"):
        view("x", 0, mem="HBM")
    with pytest.raises(CacheViewError, match=r"view 'x': group_id must be >= 0"):
        view("x", 0, group=-1)
    with pytest.raises(CacheViewError, match="outside the registration range"):
        view("x", 0, n=4, reg=(0, 32))


def test_from_range() -> None:
    v = CacheView.from_range("l.0", 0x1000, 4096, group_id=1, num_blocks=8, mem_type="DRAM")
    assert (v.block_stride, v.block_len, v.registration) == (512, 512, (0x1000, 4096))
    v = CacheView.from_range("l.0", 0, 4096, group_id=0, num_blocks=8, mem_type="VRAM",
                             block_len=256)
    assert (v.block_len, v.block_stride) == (256, 512)
    with pytest.raises(CacheViewError, match="not a multiple of num_blocks"):
        CacheView.from_range("l.0", 0, 100, group_id=0, num_blocks=3, mem_type="VRAM")


def test_from_tensor_torch_strided_alias() -> None:
    torch = pytest.importorskip("torch")
    backing = torch.zeros((4, 2, 8), dtype=torch.float32)  # block stride 64 B
    page_view = backing[:, 0, :]  # 32 B per block, stride 64 B
    v = CacheView.from_tensor("l.0", page_view, group_id=0)
    assert (v.num_blocks, v.block_len, v.block_stride) == (4, 32, 64)
    assert v.mem_type == "DRAM" and v.device_id == 0
    assert v.registration == (backing.data_ptr(), backing.untyped_storage().nbytes())
    flat = torch.zeros(64, dtype=torch.uint8)
    v = CacheView.from_tensor("l.1", flat, group_id=0, num_blocks=4)
    assert (v.block_len, v.block_stride) == (16, 16)
    with pytest.raises(CacheViewError, match="needs num_blocks"):
        CacheView.from_tensor("l.1", flat, group_id=0)
    with pytest.raises(CacheViewError, match="tensor-like"):
        CacheView.from_tensor("l.2", object(), group_id=0)
    with pytest.raises(CacheViewError, match="num_blocks 5 exceeds the view's 4 rows"):
        CacheView.from_tensor("l.0", page_view, group_id=0, num_blocks=5)


def test_from_tensor_ppl_splits_logical_rows() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((3, 4, 8), dtype=torch.float16)  # 3 logical blocks of 64 B
    v = CacheView.from_tensor("l.0", t, group_id=0, ppl=2)
    assert (v.num_blocks, v.block_len, v.block_stride) == (6, 32, 32)
    plan = plan_regions([v])
    assert local_descriptor_table(plan)[:, 0].tolist() == [t.data_ptr() + 32 * i
                                                           for i in range(6)]
    with pytest.raises(CacheViewError, match="does not split into ppl=3"):
        CacheView.from_tensor("l.0", t, group_id=0, ppl=3)


# -- descriptor tables ----------------------------------------------------------------------


def test_local_table_with_block_size_ratio() -> None:
    plan = plan_regions([view("a", 0, n=2, length=16, stride=32), view("b", 1000, n=1)])
    table = local_descriptor_table(plan, 2)
    assert table[:, 0].tolist() == [0, 8, 32, 40, 1000, 1008]
    assert table[:, 1].tolist() == [8] * 6
    with pytest.raises(GeometryError, match=r"region 0 \('a'\): block_len 16 .*ratio 3"):
        local_descriptor_table(plan, 3)


def test_local_split_table_narrows_only_split_regions() -> None:
    plan = plan_regions([view("a", 0, n=2, mla=False), view("b", 1000, n=1, mla=True)])
    t1 = local_descriptor_table(plan, split_reads=2, split_index=1)
    assert t1[:, 0].tolist() == [8, 24, 1000] and t1[:, 1].tolist() == [8, 8, 16]


def test_remote_table_rank_offset_and_lengths() -> None:
    t = remote_descriptor_table([100, 1000], [32, 16], [2, 3], [8, 16], 7, rank_offsets=[8, 0])
    assert t.tolist() == [
        [108, 8, 7], [140, 8, 7], [1000, 16, 7], [1016, 16, 7], [1032, 16, 7],
    ]
    with pytest.raises(GeometryError, match="block_strides has shape"):
        remote_descriptor_table([100, 1000], [32], [2, 3], 8, 0)


def test_high_addresses_stay_exact() -> None:
    base = 2**63 + 12345
    t = remote_descriptor_table([base], [2**20], [3], 64, 0)
    assert [int(x) for x in t[:, 0]] == [base + i * 2**20 for i in range(3)]
