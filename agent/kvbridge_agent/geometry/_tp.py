"""Tensor-parallel mapping between D (local) and P (remote) ranks (spec §1.9)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import rules
from ._errors import GeometryError, TPMappingError

__all__ = ["TPMapping", "compute_tp_mapping", "handshake_target_ranks", "tp_ratio"]

_LOCAL_NAMES = {"tp_rank": "local_tp_rank", "tp_size": "local_tp"}


def _check_size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TPMappingError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_rank(rank: int, size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TPMappingError(f"local_tp_rank must be an int, got {rank!r}")
    if bad := rules.tp_rank(rank, size, name=_LOCAL_NAMES.__getitem__):
        raise TPMappingError(bad.message)
    return rank


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """``local_tp // remote_tp`` when local >= remote (several D ranks read one P rank),
    else ``-(remote_tp // local_tp)`` (one D rank reads several P ranks).

    The larger size must be a multiple of the smaller (:class:`TPMappingError`).
    """
    local_tp = _check_size("local_tp", local_tp)
    remote_tp = _check_size("remote_tp", remote_tp)
    if bad := rules.sizes_divide("tp", local_tp, remote_tp, field="local_tp",
                                 other_field="remote_tp"):
        raise TPMappingError(bad.message)
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


def handshake_target_ranks(local_tp_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """Remote TP ranks a D rank handshakes with: ``[rank // r]`` for a ratio r > 0,
    ``[rank*|r| + i for i < |r|]`` for r < 0."""
    r = tp_ratio(local_tp, remote_tp)
    rank = _check_rank(local_tp_rank, local_tp)
    if r > 0:
        return [rank // r]
    return [rank * -r + i for i in range(-r)]


@dataclass(frozen=True)
class TPMapping:
    """How one D rank reads from a remote engine's ranks.

    ``source_ranks``: P ranks to read from. ``split_reads``: how many P ranks each SPLIT
    block is read from (1 unless P_TP > D_TP). ``rank_offset_factor``: this rank's head
    slice inside a P block when D_TP > P_TP. ``local_consumers``: D ranks that read (and
    notify) each P rank, the ``expected`` of the ``"req:expected"`` notification.
    ``notify_ranks``: P ranks to notify without reading (MLA replicas when P_TP > D_TP).
    """

    tp_ratio: int
    source_ranks: tuple[int, ...]
    split_reads: int
    rank_offset_factor: int
    local_consumers: int
    notify_ranks: tuple[int, ...] = ()

    def read_len(self, local_block_len: int, is_mla: bool, block_size_ratio: int = 1) -> int:
        """Bytes read per remote descriptor: ``len/k``, divided by ``split_reads`` (SPLIT)."""
        sub = _divide(local_block_len, block_size_ratio, "block_size_ratio")
        return sub if is_mla else _divide(sub, self.split_reads, "split_reads")

    def rank_offset(self, local_block_len: int, is_mla: bool, block_size_ratio: int = 1) -> int:
        """Byte offset of this rank's slice in a remote block: 0 for MLA (REPLICATE),
        ``rank_offset_factor * len/k`` for SPLIT."""
        if is_mla:
            return 0
        return self.rank_offset_factor * _divide(
            local_block_len, block_size_ratio, "block_size_ratio"
        )


def _divide(value: int, by: int, what: str) -> int:
    if by < 1 or value % by:
        raise GeometryError(f"block length {value} is not divisible by {what} {by}")
    return value // by


def compute_tp_mapping(
    local_tp_rank: int, local_tp: int, remote_tp: int, *, is_mla: bool
) -> TPMapping:
    """The :class:`TPMapping` of D rank ``local_tp_rank`` (spec §1.9).

    MLA (REPLICATE) reads one replica: P rank ``rank*remote_tp // local_tp``; when
    P_TP > D_TP the other P ranks it covers are notified without a read. Full attention
    (SPLIT) reads rank ``rank // r`` at head slot ``rank % r`` when r > 0, or each of the
    ``|r|`` P ranks it covers (``split_reads = |r|``) when r < 0.
    """
    r = tp_ratio(local_tp, remote_tp)
    rank = _check_rank(local_tp_rank, local_tp)
    consumers = r if r > 0 else 1
    if is_mla:
        source = rank * remote_tp // local_tp
        notify = tuple(t for t in handshake_target_ranks(rank, local_tp, remote_tp) if t != source)
        return TPMapping(r, (source,), 1, 0, consumers, notify)
    if r > 0:
        return TPMapping(r, (rank // r,), 1, rank % r, consumers)
    return TPMapping(r, tuple(handshake_target_ranks(rank, local_tp, remote_tp)), -r, 0, consumers)
