"""The public surface of kvbridge_agent.geometry (CONTRACTS.md) and its purity."""

from __future__ import annotations

import inspect
import subprocess
import sys

import kvbridge_agent.geometry as geometry

CONTRACT = {
    "GeometryError", "RegionAliasError", "MemoryTypeConflictError", "BlockIdRangeError",
    "PrefixAlignmentError", "GroupLayoutError", "TPMappingError", "UnsupportedGeometryError",
    "MEM_TYPES", "CacheView", "Region", "RegistrationRange", "RegionPlan", "region_sort_key",
    "plan_regions", "local_descriptor_table", "remote_descriptor_table", "MemTypeIndex",
    "mem_type_index", "split_table_by_mem_type", "TransferPart", "partition_by_mem_type",
    "compute_desc_ids", "block_ids_by_region", "align_prefix_by_region",
    "align_prefix_by_group", "expand_logical_to_kernel", "map_to_sub_blocks", "tp_ratio",
    "handshake_target_ranks", "TPMapping", "compute_tp_mapping",
}
ADDED = {"CacheViewError", "DescIdLayout", "SHARED_GROUP_ID", "capacity_offsets",
         "tensor_mem_type", "untransferred_ranges"}


def test_all_is_exactly_the_contract_plus_additions() -> None:
    assert set(geometry.__all__) == CONTRACT | ADDED
    public = {n for n in vars(geometry) if not n.startswith("_")}
    assert public == set(geometry.__all__)


def test_contract_parameter_names() -> None:
    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert params(geometry.compute_desc_ids)[:5] == [
        "block_ids", "region_num_blocks", "region_group_ids", "uses_group_mapping",
        "block_size_ratio",
    ]
    assert params(geometry.align_prefix_by_region)[:4] == [
        "decode", "prefill", "num_computed_blocks", "num_remote_blocks",
    ]
    assert params(geometry.remote_descriptor_table) == [
        "addrs", "block_strides", "region_num_blocks", "read_lens", "device_id",
        "rank_offsets",
    ]
    assert params(geometry.partition_by_mem_type) == [
        "local_ids", "remote_ids", "local_index", "remote_index",
    ]
    assert params(geometry.compute_tp_mapping) == [
        "local_tp_rank", "local_tp", "remote_tp", "is_mla",
    ]
    assert [f for f in geometry.CacheView.__dataclass_fields__] == [
        "name", "group_id", "addr", "num_blocks", "block_len", "block_stride", "mem_type",
        "device_id", "reg_base", "reg_nbytes", "is_mla",
    ]
    assert issubclass(geometry.GeometryError, ValueError)
    assert issubclass(geometry.UnsupportedGeometryError, NotImplementedError)


def test_import_pulls_in_no_nixl_zmq_k8s_or_torch() -> None:
    code = (
        "import sys, kvbridge_agent.geometry\n"
        "bad = [m for m in ('torch', 'zmq', 'nixl', 'nixl_cu12', 'kubernetes', 'kopf')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
