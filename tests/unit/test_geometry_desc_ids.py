"""compute_desc_ids: spec vectors (vectors/desc-ids.json), worked examples §3.9 A–F."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_agent.geometry import (
    BlockIdRangeError,
    DescIdLayout,
    GeometryError,
    GroupLayoutError,
    align_prefix_by_region,
    block_ids_by_region,
    compute_desc_ids,
    map_to_sub_blocks,
)
from spec_vectors import load_vectors


def _load_vectors() -> list[dict]:
    vectors = load_vectors("desc-ids.json")["vectors"]
    assert vectors, "desc-ids.json holds no vectors"
    return vectors


def test_vectors_file_present_and_complete() -> None:
    # A separate, non-parametrized test so a missing file fails loudly instead of
    # collecting zero cases.
    assert len(_load_vectors()) >= 40


@pytest.fixture(scope="module")
def vectors() -> list[dict]:
    return _load_vectors()


def test_every_spec_vector(vectors: list[dict]) -> None:
    failures = []
    for i, v in enumerate(vectors):
        got = compute_desc_ids(
            v["block_ids"],
            v["region_num_blocks"],
            v["region_group_ids"],
            block_size_ratio=v["block_size_ratio"],
        )
        assert got.dtype == np.int64
        if got.tolist() != v["desc_ids"]:
            failures.append((i, got.tolist(), v["desc_ids"]))
    assert not failures, f"{len(failures)} vector(s) differ: {failures[:3]}"


def test_every_spec_vector_with_numpy_inputs(vectors: list[dict]) -> None:
    for v in vectors:
        got = compute_desc_ids(
            [np.asarray(b, dtype=np.int32) for b in v["block_ids"]],
            np.asarray(v["region_num_blocks"]),
            np.asarray(v["region_group_ids"]),
            block_size_ratio=v["block_size_ratio"],
        )
        assert got.tolist() == v["desc_ids"]


def test_id_table_gives_every_fast_path_vector(vectors: list[dict]) -> None:
    """The id table the pull route gathers from: the columns of a request's blocks, row by
    row, are desc_ids' ids in its order, for every spec vector on the fast path."""
    checked = 0
    for v in vectors:
        layout = DescIdLayout(v["region_num_blocks"], v["region_group_ids"],
                              block_size_ratio=v["block_size_ratio"])
        table = layout.id_table()
        if layout.uses_group_mapping:
            assert table is None
            continue
        flat = [b for entry in v["block_ids"] for b in entry]
        if table is None or not flat or max(flat) >= table.shape[1]:
            continue   # no regions, or an id past a region: desc_ids raises (tested above)
        assert table.dtype == np.int32 and table.shape == (len(v["region_num_blocks"]),
                                                           int(layout.capacities.min()))
        assert table.take(flat, 1).ravel().tolist() == v["desc_ids"]
        checked += 1
    assert checked >= 5


def test_id_table_only_where_ids_fit_int32() -> None:
    layout = DescIdLayout([10, 6, 10], [0, 0, 0])
    table = layout.id_table()
    assert table is layout.id_table()          # built once
    assert table.tolist() == [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15],
                              [16, 17, 18, 19, 20, 21]]
    with pytest.raises(ValueError):
        table[0, 0] = 1
    # the last region's last id is 2**31 - 1: still an int32 (a table of 2 columns)
    assert DescIdLayout([2**31 - 2, 2], [0, 0]).id_table()[1].tolist() == [2**31 - 2,
                                                                           2**31 - 1]
    assert DescIdLayout([2**31 - 1, 2], [0, 0]).id_table() is None
    assert DescIdLayout([], []).id_table() is None
    assert DescIdLayout([4, 4], [0, 1]).id_table() is None   # group-mapped


# -- §3.9 worked examples -------------------------------------------------------------------


def test_example_a_v10_compatible() -> None:
    got = compute_desc_ids([[2, 5]], [10, 10, 10], [0, 0, 0])
    assert got.tolist() == [2, 5, 12, 15, 22, 25]


def test_example_b_different_capacities() -> None:
    got = compute_desc_ids([[2, 5]], [10, 6, 10], [0, 0, 0])
    assert got.tolist() == [2, 5, 12, 15, 18, 21]


def test_example_c_group_mapping_with_shared_region() -> None:
    got = compute_desc_ids([[2, 5], [7]], [10] * 4, [0, 1, -1, 1])
    assert got.tolist() == [2, 5, 22, 25, 17, 27, 37]


def test_example_d_block_size_ratio_local_side() -> None:
    sub = map_to_sub_blocks([2, 5], 2)
    assert sub.tolist() == [4, 5, 10, 11]
    got = compute_desc_ids([sub], [10, 6], [0, 0], block_size_ratio=2)
    assert got.tolist() == [4, 5, 10, 11, 24, 25, 30, 31]
    # The remote call (k=None, remote capacities) pairs one-to-one, 4 per region.
    remote = compute_desc_ids([[0, 1, 2, 3]], [8, 8], [0, 0])
    assert remote.size == got.size


def test_example_e_region_mapped_pure_mla() -> None:
    d_groups, d_caps = [0, 0, 1], [20, 20, 64]
    p_groups, p_caps = [0, 0, 0], [16, 16, 16]
    d_by_region = block_ids_by_region([[10, 11, 12], [40, 41]], d_groups)
    p_by_region = block_ids_by_region([[3, 4, 5, 6]], p_groups)
    assert [x.tolist() for x in d_by_region] == [[10, 11, 12], [10, 11, 12], [40, 41]]
    assert [x.tolist() for x in p_by_region] == [[3, 4, 5, 6]] * 3
    local, remote = align_prefix_by_region(d_by_region, p_by_region)
    assert [x.tolist() for x in remote] == [[4, 5, 6], [4, 5, 6], [5, 6]]
    r = len(d_caps)
    local_ids = compute_desc_ids(local, d_caps, list(range(r)), uses_group_mapping=r > 1)
    remote_ids = compute_desc_ids(remote, p_caps, list(range(r)), uses_group_mapping=r > 1)
    assert local_ids.tolist() == [10, 11, 12, 30, 31, 32, 80, 81]
    assert remote_ids.tolist() == [4, 5, 6, 20, 21, 22, 37, 38]


def test_example_f_shared_region_expansion() -> None:
    assert [x.tolist() for x in block_ids_by_region(([0], [2]), [-1])] == [[0, 2]]


# -- paths and edge cases -------------------------------------------------------------------


def test_all_shared_regions_take_fast_path() -> None:
    # All -1: one distinct id, no mapping; every region gets every entry's ids.
    got = compute_desc_ids([[1], [2]], [4, 5], [-1, -1])
    assert got.tolist() == [1, 2, 5, 6]


def test_forced_mapping_flag_overrides_derivation() -> None:
    # uses_group_mapping=False on a two-group layout: every region gets every id.
    got = compute_desc_ids([[1], [2]], [4, 5], [0, 1], uses_group_mapping=False)
    assert got.tolist() == [1, 2, 5, 6]
    got = compute_desc_ids([[1, 2]], [4, 5], [0, 0], uses_group_mapping=True)
    assert got.tolist() == [1, 2, 5, 6]


def test_empty_inputs_give_empty_int64() -> None:
    for got in (
        compute_desc_ids([[]], [4], [0]),
        compute_desc_ids([], [4], [0]),
        compute_desc_ids([[], []], [4, 4], [0, 1]),
    ):
        assert got.dtype == np.int64 and got.size == 0


def test_region_with_unused_group_gets_nothing() -> None:
    # Region 1 belongs to group 5, which the request does not carry (the #55398 sentinel).
    got = compute_desc_ids([[1], [2]], [4, 4, 4], [0, 5, 1])
    assert got.tolist() == [1, 10]


def test_block_id_out_of_range_names_group_and_region() -> None:
    with pytest.raises(BlockIdRangeError, match=r"block id 6 of group 1 .*region 2: capacity 6"):
        compute_desc_ids([[0], [6]], [10, 10, 6], [0, 1, 1])
    with pytest.raises(BlockIdRangeError, match=r"region 1 \('layers\.1'\).*capacity 4"):
        compute_desc_ids([[4]], [8, 4], [0, 0], region_names=["layers.0", "layers.1"])
    with pytest.raises(BlockIdRangeError, match=r"block id -1"):
        compute_desc_ids([[-1]], [8], [0])
    with pytest.raises(BlockIdRangeError, match=r"block_size_ratio 2"):
        compute_desc_ids([[8]], [4], [0], block_size_ratio=2)
    assert isinstance(BlockIdRangeError("x"), ValueError)


def test_group_without_region_is_an_error() -> None:
    with pytest.raises(GroupLayoutError, match=r"group 2 has 1 block id\(s\) but no region"):
        compute_desc_ids([[0], [1], [2]], [4, 4], [0, 1])


def test_layout_argument_errors() -> None:
    with pytest.raises(GroupLayoutError, match="region_num_blocks has 2 entries but"):
        compute_desc_ids([[0]], [4, 4], [0])
    with pytest.raises(GroupLayoutError, match=r"region_group_ids\[1\] must be"):
        compute_desc_ids([[0]], [4, 4], [0, -2])
    with pytest.raises(GeometryError, match="block_size_ratio must be"):
        compute_desc_ids([[0]], [4], [0], block_size_ratio=0)
    with pytest.raises(GeometryError, match="must be integers"):
        compute_desc_ids([[0.5]], [4], [0])
    with pytest.raises(GeometryError, match="flat array"):
        compute_desc_ids(np.array([1, 2]), [4], [0])
    with pytest.raises(GroupLayoutError, match="no regions"):
        compute_desc_ids([[0]], [], [])


def test_many_groups_range_check_is_exact() -> None:
    # > 4 non-empty groups: validated for all groups at once; the boundary id is caught.
    caps, ident = [5, 6, 7, 8, 9, 10], list(range(6))
    ok = [[c - 1] for c in caps]
    assert compute_desc_ids(ok, caps, ident).tolist() == [4, 10, 17, 25, 34, 44]
    bad = [*ok[:5], [10]]
    with pytest.raises(BlockIdRangeError, match=r"block id 10 of group 5 .*region 5: capacity 10"):
        compute_desc_ids(bad, caps, ident)
    with pytest.raises(BlockIdRangeError, match=r"block id -1 of group 2 .*region 2"):
        compute_desc_ids([[0], [0], [-1], [0], [0], [0]], caps, ident)
    # with a shared region every group also targets region 6 (capacity 3)
    shared = [*caps, 3]
    with pytest.raises(BlockIdRangeError, match=r"block id 3 of group 4 .*region 6: capacity 3"):
        compute_desc_ids([[0], [1], [2], [0], [3], [0]], shared, [*ident, -1])
    with pytest.raises(GroupLayoutError, match="group 6 has 1 block id"):
        compute_desc_ids([[0]] * 7, caps, ident)


def test_layout_is_reusable_and_read_only() -> None:
    layout = DescIdLayout([10, 6, 10], [0, 0, 0])
    assert layout.desc_ids([[2, 5]]).tolist() == [2, 5, 12, 15, 18, 21]
    assert layout.desc_ids([[0]]).tolist() == [0, 10, 16]
    assert layout.offsets.tolist() == [0, 10, 16] and not layout.uses_group_mapping
    with pytest.raises(ValueError):
        layout.offsets[0] = 1
    with pytest.raises(AttributeError):
        layout.uses_group_mapping = True  # type: ignore[misc]


def test_implausible_group_id_is_rejected() -> None:
    with pytest.raises(GroupLayoutError, match=r"region_group_ids\[1\] is 65536"):
        compute_desc_ids([[0]], [4, 4], [0, 1 << 16])


def test_many_groups_with_shared_regions() -> None:
    # > 4 groups, each with its own region plus the shared one: two targets per group.
    caps, gids = [4, 4, 4, 4, 4, 8], [0, 1, 2, 3, 4, -1]
    got = compute_desc_ids([[g % 4] for g in range(5)], caps, gids)
    assert got.tolist() == [x for g in range(5) for x in (4 * g + g % 4, 20 + g % 4)]
    # groups that own no region reach only the shared region (here region 1)
    got = compute_desc_ids([[g, 7] for g in range(6)], [4, 8], [7, -1])
    assert got.tolist() == [4 + x for g in range(6) for x in (g, 7)]
