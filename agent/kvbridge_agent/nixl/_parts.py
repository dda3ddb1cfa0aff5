"""Create the NIXL transfer for one (local kind, remote kind) part: prepared-list indices,
or, with coalescing on and enough adjacency, one merged one-shot transfer."""

from __future__ import annotations

import numpy as np

from ._agent import DList, NixlAgent, XferHandle
from ._coalesce import coalesce_rows

__all__ = ["make_part"]

#: Coalesce only when merging removes at least this fraction of the descriptors: a one-shot
#: transfer costs a table gather plus NIXL list creation that prepared indices do not.
MIN_MERGE_GAIN = 0.5


def make_part(
    agent: NixlAgent,
    op: str,
    local: DList,
    local_pos: np.ndarray,
    remote: DList,
    remote_pos: np.ndarray,
    *,
    coalesce: bool,
    notif: bytes = b"",
    label: str = "",
) -> XferHandle:
    if coalesce and local_pos.size > 1:
        lrows, rrows = coalesce_rows(local.table[local_pos], remote.table[remote_pos])
        if lrows.shape[0] <= local_pos.size * (1.0 - MIN_MERGE_GAIN):
            return agent.make_direct(op, lrows, rrows, (local.kind, remote.kind), remote.peer,
                                     notif=notif, label=label + " coalesced")
    return agent.make_prepped(op, local, local_pos, remote, remote_pos, notif=notif, label=label)
