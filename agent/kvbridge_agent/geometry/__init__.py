"""Pure KV-cache transfer geometry for the NIXL connector at version 11.

Region planning (spec §2), descriptor tables (§2.7), descriptor ids (§3), per-region
alignment (§4.3–§4.4), memory-type partitions (§4.6), the byte ranges a receiver zeroes
(§4.9) and tensor-parallel mapping (§1.9).
numpy only: no NIXL, ZMQ, Kubernetes or torch import, so the operator can share it.
Errors are :class:`GeometryError` subclasses (tree in ``_errors``).

spec §N: sections of docs/protocol.md.
"""

from ._alignment import (
    align_prefix_by_group,
    align_prefix_by_region,
    block_ids_by_region,
    expand_logical_to_kernel,
    map_to_sub_blocks,
)
from ._desc_ids import DescIdLayout, compute_desc_ids
from ._descriptors import capacity_offsets, local_descriptor_table, remote_descriptor_table
from ._errors import (
    BlockIdRangeError,
    CacheViewError,
    GeometryError,
    GroupLayoutError,
    MemoryTypeConflictError,
    PrefixAlignmentError,
    RegionAliasError,
    TPMappingError,
    UnsupportedGeometryError,
)
from ._memtypes import (
    MemTypeIndex,
    TransferPart,
    mem_type_index,
    partition_by_mem_type,
    split_table_by_mem_type,
)
from ._regions import (
    SHARED_GROUP_ID,
    Region,
    RegionPlan,
    RegistrationRange,
    plan_regions,
    region_sort_key,
)
from ._tp import TPMapping, compute_tp_mapping, handshake_target_ranks, tp_ratio
from ._views import MEM_TYPES, CacheView, tensor_mem_type
from ._zeroing import untransferred_ranges

__all__ = [
    "MEM_TYPES",
    "SHARED_GROUP_ID",
    "BlockIdRangeError",
    "CacheView",
    "CacheViewError",
    "DescIdLayout",
    "GeometryError",
    "GroupLayoutError",
    "MemTypeIndex",
    "MemoryTypeConflictError",
    "PrefixAlignmentError",
    "Region",
    "RegionAliasError",
    "RegionPlan",
    "RegistrationRange",
    "TPMapping",
    "TPMappingError",
    "TransferPart",
    "UnsupportedGeometryError",
    "align_prefix_by_group",
    "align_prefix_by_region",
    "block_ids_by_region",
    "capacity_offsets",
    "compute_desc_ids",
    "compute_tp_mapping",
    "expand_logical_to_kernel",
    "handshake_target_ranks",
    "local_descriptor_table",
    "map_to_sub_blocks",
    "mem_type_index",
    "partition_by_mem_type",
    "plan_regions",
    "region_sort_key",
    "remote_descriptor_table",
    "split_table_by_mem_type",
    "tensor_mem_type",
    "tp_ratio",
    "untransferred_ranges",
]
