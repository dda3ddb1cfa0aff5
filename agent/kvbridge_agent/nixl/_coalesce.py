"""Merge runs of descriptors that are adjacent in memory on both sides.

A transfer part pairs local descriptor i with remote descriptor i. Where descriptor i+1
starts exactly where i ends on *both* sides (same device), the two can move as one
descriptor. NIXL prepared lists index fixed descriptors, so a merged transfer is built as a
one-shot ``initialize_xfer`` from the merged (addr, len, dev) rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["coalesce_rows"]


def coalesce_rows(
    local_rows: np.ndarray, remote_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge positionally paired (N, 3) uint64 rows into maximal adjacent runs.

    Returns new (M, 3) arrays with M <= N covering exactly the same bytes in the same
    pairing. Pairs whose lengths differ are never merged with a neighbour.
    """
    n = int(local_rows.shape[0])
    if n <= 1:
        return local_rows, remote_rows
    la, ll, ld = local_rows[:, 0], local_rows[:, 1], local_rows[:, 2]
    ra, rl, rd = remote_rows[:, 0], remote_rows[:, 1], remote_rows[:, 2]
    joins = (
        (la[1:] == la[:-1] + ll[:-1])
        & (ra[1:] == ra[:-1] + rl[:-1])
        & (ld[1:] == ld[:-1])
        & (rd[1:] == rd[:-1])
        & (ll[:-1] == rl[:-1])
        & (ll[1:] == rl[1:])
    )
    if not joins.any():
        return local_rows, remote_rows
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lens = np.add.reduceat(ll, starts)
    lout = np.stack([la[starts], lens, ld[starts]], axis=1)
    rlens = np.add.reduceat(rl, starts)
    rout = np.stack([ra[starts], rlens, rd[starts]], axis=1)
    return lout, rout
