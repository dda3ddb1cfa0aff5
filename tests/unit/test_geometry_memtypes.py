"""Memory-type index and transfer partition (spec §2.7 mixed mode, §4.6)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_agent.geometry import (
    BlockIdRangeError,
    GroupLayoutError,
    mem_type_index,
    partition_by_mem_type,
    split_table_by_mem_type,
)


def test_section_4_6_worked_example() -> None:
    local = mem_type_index(["VRAM", "DRAM", "VRAM"], [4, 6, 4])
    assert local.mem_types == ("DRAM", "VRAM")
    assert local.is_dram.astype(int).tolist() == [0] * 4 + [1] * 6 + [0] * 4
    assert local.desc_pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    remote = mem_type_index(["VRAM"] * 3, [20, 20, 20])
    parts = partition_by_mem_type(
        [1, 2, 7, 8, 10, 11], [11, 12, 31, 32, 51, 52], local, remote
    )
    assert [(p.local_mem_type, p.remote_mem_type) for p in parts] == [
        ("DRAM", "VRAM"), ("VRAM", "VRAM"),
    ]
    assert parts[0].local_ids.tolist() == [3, 4] and parts[0].remote_ids.tolist() == [31, 32]
    assert parts[1].local_ids.tolist() == [1, 2, 4, 5]
    assert parts[1].remote_ids.tolist() == [11, 12, 51, 52]


def test_pairs_of_memory_types_on_both_sides() -> None:
    local = mem_type_index(["VRAM", "DRAM"], [2, 2])
    remote = mem_type_index(["DRAM", "VRAM"], [2, 2])
    parts = partition_by_mem_type([0, 1, 2, 3], [3, 0, 2, 1], local, remote)
    got = {(p.local_mem_type, p.remote_mem_type): (p.local_ids.tolist(), p.remote_ids.tolist())
           for p in parts}
    assert got == {
        ("DRAM", "DRAM"): ([1], [1]),
        ("DRAM", "VRAM"): ([0], [0]),
        ("VRAM", "DRAM"): ([1], [0]),
        ("VRAM", "VRAM"): ([0], [1]),
    }
    assert sum(len(p) for p in parts) == 4


def test_single_type_is_one_identity_part() -> None:
    idx = mem_type_index(["VRAM"] * 2, [3, 3])
    (part,) = partition_by_mem_type([5, 0], [1, 2], idx, idx)
    assert part.local_ids.tolist() == [5, 0] and part.remote_ids.tolist() == [1, 2]
    assert partition_by_mem_type([], [], idx, idx) == []


def test_block_size_ratio_and_split_table() -> None:
    idx = mem_type_index(["DRAM", "VRAM"], [1, 2], block_size_ratio=2)
    assert idx.desc_type.tolist() == [0, 0, 1, 1, 1, 1]
    assert idx.desc_pos.tolist() == [0, 1, 0, 1, 2, 3]
    assert (idx.count("DRAM"), idx.count("VRAM"), idx.count("X")) == (2, 4, 0)
    table = np.arange(18, dtype=np.uint64).reshape(6, 3)
    split = split_table_by_mem_type(table, idx)
    assert split["DRAM"][:, 0].tolist() == [0, 3]
    assert split["VRAM"][:, 0].tolist() == [6, 9, 12, 15]


def test_errors() -> None:
    idx = mem_type_index(["VRAM"], [3])
    with pytest.raises(GroupLayoutError, match="local_ids has 2 ids but remote_ids has 1"):
        partition_by_mem_type([0, 1], [0], idx, idx)
    with pytest.raises(BlockIdRangeError, match="remote descriptor id 3"):
        partition_by_mem_type([0], [3], idx, idx)
    with pytest.raises(GroupLayoutError, match="region_mem_types has 2 entries"):
        mem_type_index(["VRAM", "DRAM"], [3])
    with pytest.raises(GroupLayoutError, match="descriptor table has 2 rows"):
        split_table_by_mem_type(np.zeros((2, 3), dtype=np.uint64), idx)
