"""Tensor-parallel mapping (spec §1.9)."""

from __future__ import annotations

import pytest

from kvbridge_agent.geometry import (
    GeometryError,
    TPMappingError,
    compute_tp_mapping,
    handshake_target_ranks,
    tp_ratio,
)


@pytest.mark.parametrize(
    ("local", "remote", "ratio"),
    [(1, 1, 1), (4, 2, 2), (8, 1, 8), (2, 4, -2), (1, 8, -8)],
)
def test_tp_ratio(local: int, remote: int, ratio: int) -> None:
    assert tp_ratio(local, remote) == ratio


def test_tp_ratio_errors() -> None:
    with pytest.raises(TPMappingError,
                       match=r"local_tp: expected a multiple or divisor of remote_tp \(2\), got 3"):
        tp_ratio(3, 2)
    with pytest.raises(TPMappingError, match="remote_tp must be an int >= 1, got 0"):
        tp_ratio(1, 0)


def test_handshake_target_ranks() -> None:
    assert [handshake_target_ranks(r, 4, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert handshake_target_ranks(1, 2, 8) == [4, 5, 6, 7]
    with pytest.raises(TPMappingError,
                       match=r"local_tp_rank: expected a rank below local_tp \(2\), got 2"):
        handshake_target_ranks(2, 2, 8)


def test_mla_reads_one_replica() -> None:
    # P_TP > D_TP: D rank 1 of 2 reads P rank 1*8//2 = 4, notifies 5, 6, 7 without a read.
    m = compute_tp_mapping(1, 2, 8, is_mla=True)
    assert (m.tp_ratio, m.source_ranks, m.split_reads, m.rank_offset_factor) == (-4, (4,), 1, 0)
    assert m.notify_ranks == (5, 6, 7) and m.local_consumers == 1
    assert m.read_len(1024, True) == 1024 and m.rank_offset(1024, True) == 0
    # D_TP > P_TP: 4 D ranks share P rank 0's replica.
    m = compute_tp_mapping(3, 4, 1, is_mla=True)
    assert m.source_ranks == (0,) and m.local_consumers == 4 and m.notify_ranks == ()


def test_split_when_decode_has_more_ranks() -> None:
    m = compute_tp_mapping(3, 4, 2, is_mla=False)
    assert (m.source_ranks, m.split_reads, m.rank_offset_factor, m.local_consumers) == (
        (1,), 1, 1, 2,
    )
    assert m.read_len(512, False) == 512 and m.rank_offset(512, False) == 512
    assert m.read_len(512, False, 2) == 256 and m.rank_offset(512, False, 2) == 256


def test_split_when_prefill_has_more_ranks() -> None:
    m = compute_tp_mapping(1, 2, 4, is_mla=False)
    assert (m.source_ranks, m.split_reads, m.rank_offset_factor, m.local_consumers) == (
        (2, 3), 2, 0, 1,
    )
    assert m.read_len(512, False) == 256 and m.rank_offset(512, False) == 0
    with pytest.raises(GeometryError, match="not divisible by split_reads 2"):
        m.read_len(3, False)


def test_every_p_rank_is_read_by_local_consumers_d_ranks() -> None:
    for local, remote in [(4, 2), (2, 4), (8, 1), (1, 4), (3, 3)]:
        for mla in (True, False):
            readers: dict[int, int] = {}
            for rank in range(local):
                m = compute_tp_mapping(rank, local, remote, is_mla=mla)
                for p in m.source_ranks + m.notify_ranks:
                    readers[p] = readers.get(p, 0) + 1
                consumers = m.local_consumers
            assert sorted(readers) == list(range(remote)), (local, remote, mla)
            assert set(readers.values()) == {consumers}, (local, remote, mla)
