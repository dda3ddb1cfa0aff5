"""Memory-type split of descriptor lists and transfers (spec §2.7 mixed mode, §4.6).

One NIXL dlist holds one memory type, so a mixed engine keeps one dlist per type.
:class:`MemTypeIndex` maps every descriptor of the full (region-major) list to its type
and its position inside that type's list; :func:`partition_by_mem_type` splits a paired
transfer into one part per (local type, remote type) pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._descriptors import capacity_offsets
from ._errors import BlockIdRangeError, GeometryError, GroupLayoutError
from ._ids import as_ids

__all__ = [
    "MemTypeIndex",
    "TransferPart",
    "mem_type_index",
    "partition_by_mem_type",
    "split_table_by_mem_type",
]


@dataclass(frozen=True, eq=False)
class MemTypeIndex:
    """Per-descriptor memory type and position in that type's dlist (spec §2.7).

    ``desc_type[j]`` indexes ``mem_types``; ``desc_pos[j]`` is j's position inside the
    dlist of its type (descriptors of one type keep their original order).
    """

    mem_types: tuple[str, ...]
    desc_type: np.ndarray
    desc_pos: np.ndarray

    def __len__(self) -> int:
        return int(self.desc_type.shape[0])

    def count(self, mem_type: str) -> int:
        """Number of descriptors of ``mem_type`` (the length of its dlist)."""
        if mem_type not in self.mem_types:
            return 0
        return int(np.count_nonzero(self.desc_type == self.mem_types.index(mem_type)))

    @property
    def is_dram(self) -> np.ndarray:
        """vLLM's ``desc_is_dram`` mask."""
        if "DRAM" not in self.mem_types:
            return np.zeros(len(self), dtype=bool)
        return self.desc_type == self.mem_types.index("DRAM")


def mem_type_index(
    region_mem_types: Sequence[str],
    region_num_blocks: Sequence[int] | np.ndarray,
    block_size_ratio: int = 1,
) -> MemTypeIndex:
    """Build the :class:`MemTypeIndex` of a region-major list of ``num_blocks[r]*k`` rows.

    Raises :class:`GroupLayoutError` when the two per-region inputs differ in length.
    """
    types = list(region_mem_types)
    caps = np.asarray(region_num_blocks, dtype=np.int64)
    if caps.ndim != 1 or len(types) != caps.size:
        raise GroupLayoutError(
            f"region_mem_types has {len(types)} entries but region_num_blocks has "
            f"{caps.size}; both need one entry per region"
        )
    if caps.size and caps.min() < 0:
        raise GeometryError(f"region_num_blocks must be >= 0, got {caps.tolist()}")
    k = block_size_ratio
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise GeometryError(f"block_size_ratio must be an int >= 1, got {k!r}")
    for r, t in enumerate(types):
        if not isinstance(t, str) or not t:
            raise GeometryError(f"region_mem_types[{r}] must be a non-empty str, got {t!r}")
    mem_types = tuple(sorted(set(types)))
    rows = caps * int(k)
    region_type = np.array([mem_types.index(t) for t in types], dtype=np.int8)
    # Region r starts, inside its type's list, after all earlier rows of the same type.
    start_in_type = np.zeros(len(types), dtype=np.int64)
    for t in range(len(mem_types)):
        mask = region_type == t
        start_in_type[mask] = capacity_offsets(rows[mask])
    total = int(rows.sum())
    region = np.repeat(np.arange(len(types)), rows)
    within = np.arange(total, dtype=np.int64) - capacity_offsets(rows)[region]
    desc_type = region_type[region]
    desc_pos = start_in_type[region] + within
    desc_type.flags.writeable = False
    desc_pos.flags.writeable = False
    return MemTypeIndex(mem_types=mem_types, desc_type=desc_type, desc_pos=desc_pos)


def split_table_by_mem_type(table: np.ndarray, index: MemTypeIndex) -> dict[str, np.ndarray]:
    """Split an (N, 3) descriptor table into one table per memory type, order preserved."""
    if table.shape[0] != len(index):
        raise GroupLayoutError(
            f"descriptor table has {table.shape[0]} rows but the memory-type index covers "
            f"{len(index)} descriptors"
        )
    return {t: table[index.desc_type == i] for i, t in enumerate(index.mem_types)}


@dataclass(frozen=True, eq=False)
class TransferPart:
    """One (local mem type, remote mem type) slice of a transfer, as dlist positions."""

    local_mem_type: str
    remote_mem_type: str
    local_ids: np.ndarray
    remote_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.local_ids.shape[0])


def _check_range(ids: np.ndarray, index: MemTypeIndex, side: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(index)):
        bad = ids[(ids < 0) | (ids >= len(index))]
        raise BlockIdRangeError(
            f"{side} descriptor id {int(bad[0])} is outside the {side} dlist "
            f"(0..{len(index) - 1}); {bad.size} id(s) out of range"
        )


def partition_by_mem_type(
    local_ids: Sequence[int] | np.ndarray,
    remote_ids: Sequence[int] | np.ndarray,
    local_index: MemTypeIndex,
    remote_index: MemTypeIndex,
) -> list[TransferPart]:
    """Split paired descriptor ids into one part per (local, remote) memory-type pair.

    ``local_ids[i]`` pairs with ``remote_ids[i]`` (ids into the full region-major lists).
    Each part holds the positions of its pairs inside the per-type dlists of each side, in
    their original order. Parts come sorted by (local type, remote type); pairs absent
    from the request produce no part. Raises :class:`GroupLayoutError` for lists of
    different lengths and :class:`BlockIdRangeError` for ids outside either list.
    """
    loc = as_ids(local_ids, "local_ids")
    rem = as_ids(remote_ids, "remote_ids")
    if loc.size != rem.size:
        raise GroupLayoutError(
            f"local_ids has {loc.size} ids but remote_ids has {rem.size}; transfers pair "
            "them by position"
        )
    if loc.size == 0:
        return []
    _check_range(loc, local_index, "local")
    _check_range(rem, remote_index, "remote")
    n_remote = len(remote_index.mem_types)
    if len(local_index.mem_types) == 1 and n_remote == 1:
        # One type per side: a descriptor's position in its type's dlist is its id.
        return [TransferPart(local_index.mem_types[0], remote_index.mem_types[0], loc, rem)]
    lt = local_index.desc_type[loc]
    rt = remote_index.desc_type[rem]
    lpos = local_index.desc_pos[loc]
    rpos = remote_index.desc_pos[rem]
    pair = lt.astype(np.int64) * n_remote + rt
    parts = []
    for code in np.unique(pair).tolist():
        mask = pair == code
        parts.append(
            TransferPart(
                local_mem_type=local_index.mem_types[code // n_remote],
                remote_mem_type=remote_index.mem_types[code % n_remote],
                local_ids=lpos[mask],
                remote_ids=rpos[mask],
            )
        )
    return parts
