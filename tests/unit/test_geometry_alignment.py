"""Per-region expansion and prefix alignment (spec §3.6, §3.7, §4.3, §4.4)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_agent.geometry import (
    GeometryError,
    GroupLayoutError,
    PrefixAlignmentError,
    align_prefix_by_group,
    align_prefix_by_region,
    block_ids_by_region,
    expand_logical_to_kernel,
    map_to_sub_blocks,
)


def lists(xs: list[np.ndarray]) -> list[list[int]]:
    return [x.tolist() for x in xs]


def test_block_ids_by_region_groups_and_shared() -> None:
    got = block_ids_by_region([[1, 2], [7], []], [1, -1, 0, 2, 0])
    assert lists(got) == [[7], [1, 2, 7], [1, 2], [], [1, 2]]
    assert all(x.dtype == np.int64 for x in got)
    # copies: mutating one region's list leaves the others alone
    got[2][0] = 99
    assert got[4].tolist() == [1, 2]


def test_block_ids_by_region_unknown_group() -> None:
    with pytest.raises(GroupLayoutError, match=r"region 1 \('b'\) belongs to group 3"):
        block_ids_by_region([[1]], [0, 3], region_names=["a", "b"])


def test_suffix_rule_keeps_tail_of_prefill() -> None:
    local, remote = align_prefix_by_region([[10, 11], [], [5]], [[1, 2, 3], [4], [6, 7]])
    assert lists(local) == [[10, 11], [], [5]]
    assert lists(remote) == [[2, 3], [], [7]]


def test_suffix_rule_decode_longer_is_an_error() -> None:
    with pytest.raises(PrefixAlignmentError, match=r"region 1 \('x'\): decode allocated more"):
        align_prefix_by_region([[1], [1, 2]], [[1], [1]], region_names=["w", "x"])


def test_full_hit_is_notify_only() -> None:
    local, remote = align_prefix_by_region([[], []], [[1, 2], [3]])
    assert lists(local) == [[], []] and lists(remote) == [[], []]
    # even under the positional rule, and even when P would be too short
    local, remote = align_prefix_by_region([[]], [[]], num_computed_blocks=[5],
                                           num_remote_blocks=9)
    assert lists(local) == [[]] and lists(remote) == [[]]


def test_positional_rule_57077_motivation() -> None:
    # P: block 128 with 64-token kernel -> advertises [A, B, C, unused]; D has 3 pages,
    # 160-token prompt -> 3 remote kernel blocks. Suffix would pick B, C, unused.
    a, b, c, unused = 40, 41, 42, 43
    local, remote = align_prefix_by_region([[7, 8, 9]], [[a, b, c, unused]])
    assert remote[0].tolist() == [b, c, unused]
    local, remote = align_prefix_by_region([[7, 8, 9]], [[a, b, c, unused]],
                                           num_computed_blocks=[0], num_remote_blocks=3)
    assert lists(local) == [[7, 8, 9]] and lists(remote) == [[a, b, c]]


def test_positional_rule_with_prefix_hits_and_clipping() -> None:
    local, remote = align_prefix_by_region(
        [[7, 8, 9], [1, 2], [5]],
        [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [20, 21, 22]],
        num_computed_blocks=[2, 4, 9],
        num_remote_blocks=5,
    )
    assert lists(local) == [[7, 8, 9], [1], []]
    assert lists(remote) == [[2, 3, 4], [14], []]


def test_positional_rule_errors() -> None:
    with pytest.raises(PrefixAlignmentError, match=r"region 0: remote KV pages do not cover"):
        align_prefix_by_region([[1, 2]], [[5]], num_computed_blocks=[0], num_remote_blocks=2)
    with pytest.raises(PrefixAlignmentError, match="must be given together"):
        align_prefix_by_region([[1]], [[1]], num_computed_blocks=[0])
    with pytest.raises(PrefixAlignmentError, match="must be given together"):
        align_prefix_by_region([[1]], [[1]], num_remote_blocks=1)
    with pytest.raises(PrefixAlignmentError, match="one entry per region"):
        align_prefix_by_region([[1]], [[1]], num_computed_blocks=[0, 0], num_remote_blocks=1)
    with pytest.raises(PrefixAlignmentError, match="num_computed_blocks must hold ints >= 0"):
        align_prefix_by_region([[1]], [[1]], num_computed_blocks=[-1], num_remote_blocks=1)
    with pytest.raises(PrefixAlignmentError, match="num_remote_blocks must be an int"):
        align_prefix_by_region([[1]], [[1]], num_computed_blocks=[0], num_remote_blocks=-1)
    with pytest.raises(PrefixAlignmentError, match="decode has 1 region list"):
        align_prefix_by_region([[1]], [[1], [2]])


def test_group_end_trim() -> None:
    local, remote = align_prefix_by_group([[5, 6], [], [1, 2, 3]], [[1, 2, 3], [4], [8, 9]])
    assert lists(local) == [[5, 6], [], [1, 2]]
    assert lists(remote) == [[2, 3], [], [8, 9]]
    with pytest.raises(PrefixAlignmentError, match=r"group 0: .*exceeds max_padding 1"):
        align_prefix_by_group([[1, 2, 3]], [[1]], max_padding=1)
    with pytest.raises(PrefixAlignmentError, match="one list per transfer group"):
        align_prefix_by_group([[1]], [])


def test_expand_logical_to_kernel() -> None:
    assert expand_logical_to_kernel([2, 0], 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert expand_logical_to_kernel(np.array([4, 1]), 1).tolist() == [4, 1]
    assert expand_logical_to_kernel([], 4).tolist() == []
    with pytest.raises(GeometryError, match=r"ppl .* must be >= 1, got 0"):
        expand_logical_to_kernel([1], 0)


def test_map_to_sub_blocks() -> None:
    assert map_to_sub_blocks([2, 5], 2).tolist() == [4, 5, 10, 11]
    assert map_to_sub_blocks([2, 5], 4, remote_count=6).tolist() == [8, 9, 10, 11, 20, 21]
    assert map_to_sub_blocks([3], 1, remote_count=1).tolist() == [3]
    with pytest.raises(PrefixAlignmentError, match="remote_count 5 is outside"):
        map_to_sub_blocks([1, 2], 2, remote_count=5)
    with pytest.raises(GeometryError, match="block_size_ratio must be an int >= 1"):
        map_to_sub_blocks([1], 0)
