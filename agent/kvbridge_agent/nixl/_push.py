"""The push engine: the prefill side WRITEs KV blocks into decode engines (spec §5).

One WRITE per target rank, with the completion notification ``"{request_id}:{consumers}"``
attached, so NIXL delivers it after the bytes are in place. Rejected like vLLM's
``NixlPushConnector`` (spec §5, §10.11): mixed-memory caches on either side, and producer
and consumer cache-group layouts that differ (rules of :mod:`kvbridge_agent.rules`). Failure
semantics, polling and threading are those of :mod:`._pull` (a failed WRITE delivers no
notification).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import geometry as geo
from .. import rules
from ..resources import TRANSFER_TIMEOUT_S
from ._engine import TransferEngine
from ._errors import UnsupportedTransferError
from ._local import LocalEngine
from ._notifications import completion_message
from ._parts import make_part
from ._pull import DEFAULT_COALESCE
from ._remote import RemoteEngine

__all__ = ["PushEngine", "PushRequest"]


@dataclass(frozen=True)
class PushRequest:
    """One request to write this engine's blocks into a decode engine.

    Attributes:
        request_id: the id the consumer knows the request by (goes into the notification).
        remote_engine_id: the consumer engine (must have been added).
        local_block_ids: per transfer group, this (producer) engine's logical block ids.
        remote_block_ids: per transfer group, the consumer's logical block ids.
        timeout_s: deadline (default: the engine's).
    """

    request_id: str
    remote_engine_id: str
    local_block_ids: Sequence[Sequence[int]]
    remote_block_ids: Sequence[Sequence[int]]
    timeout_s: float | None = None


class PushEngine(TransferEngine):
    """Producer-side writer over one :class:`LocalEngine`.

    Raises:
        UnsupportedTransferError: the local plan mixes memory kinds.
    """

    def __init__(
        self,
        local: LocalEngine,
        *,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        coalesce: bool = DEFAULT_COALESCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bad := rules.single_memory(local.plan.mem_types, mode="push", producer=True,
                                      note=f"producer {local.engine_id!r}"):
            raise UnsupportedTransferError(bad.message)
        super().__init__(local, timeout_s=timeout_s, coalesce=coalesce, clock=clock)

    def add_remote(self, desc: RemoteEngine) -> str:
        """Load a consumer rank. Raises UnsupportedTransferError for a mixed-memory consumer
        or a different cache-group layout (before anything is loaded)."""
        note = f"consumer {desc.engine_id!r}"
        if bad := (rules.single_memory(desc.region_mem_types, mode="push", producer=False,
                                       note=note)
                   or rules.push_group_layout(self.local.group_ids, desc.region_group_ids,
                                              note=note)):
            raise UnsupportedTransferError(bad.message)
        return self.peers.add(desc).agent_name

    def remove_remote(self, engine_id: str, tp_rank: int | None = None) -> None:
        self.peers.remove(engine_id, tp_rank)

    def start(self, req: PushRequest) -> None:
        """Post the WRITEs of ``req``; failures are reported by poll()/wait()."""
        self._track(req, self._start, "write")

    def _targets(self, engine_id: str) -> tuple[list, int]:
        facts = self.local.facts
        remote_tp = self.peers.any_rank(engine_id).desc.tp_size
        if remote_tp != facts.tp_size and not self.local.pure_mla:
            raise UnsupportedTransferError(
                f"push with different TP sizes (producer {facts.tp_size}, consumer "
                f"{remote_tp}) needs a pure MLA model")
        ranks = geo.handshake_target_ranks(facts.tp_rank, facts.tp_size, remote_tp)
        consumers = max(facts.tp_size // remote_tp, 1)
        return [self.peers.get(engine_id, r) for r in ranks], consumers

    def _start(self, req: PushRequest, tracked: object) -> None:
        local = self.local
        targets, consumers = self._targets(req.remote_engine_id)
        desc = targets[0].desc
        if desc.block_size != local.facts.block_size:
            raise UnsupportedTransferError(
                f"push needs equal kernel block sizes (producer {local.facts.block_size}, "
                f"consumer {desc.block_size})")
        if bad := rules.push_group_layout(local.group_ids, desc.region_group_ids,
                                          note=f"consumer {desc.engine_id!r}"):
            raise UnsupportedTransferError(bad.message)
        mine = [geo.expand_logical_to_kernel(g, local.facts.ppl) for g in req.local_block_ids]
        theirs = [geo.expand_logical_to_kernel(g, desc.ppl) for g in req.remote_block_ids]
        d, p = geo.align_prefix_by_group(theirs, mine, max_padding=desc.ppl + local.facts.ppl)
        lids = local.desc_layout(1, False).desc_ids(p)
        rids = targets[0].layout(False).desc_ids(d)
        message = completion_message(req.request_id, consumers)
        if lids.size == 0:
            for peer in targets:
                self.agent.send_notif(peer.agent_name, message)
            return
        llists = local.lists(1)
        lens = local.plan.block_lens.astype(np.int64)
        planned = []
        for peer in targets:
            rlists = self.peers.lists(peer, ("write",), lambda peer=peer: (
                geo.remote_descriptor_table(
                    peer.desc.base_addrs, peer.desc.block_strides, peer.desc.region_num_blocks,
                    lens, peer.desc.device_id)))
            parts = geo.partition_by_mem_type(lids, rids, llists.index, peer.index)
            planned.append((peer, rlists, parts))
        for peer, rlists, parts in planned:
            for part in parts:   # one part: both sides are single-kind
                x = make_part(
                    self.agent, "WRITE", llists.by_kind[part.local_mem_type], part.local_ids,
                    rlists[part.remote_mem_type], part.remote_ids, coalesce=self.coalesce,
                    notif=message, label=f"{req.request_id} WRITE@{peer.agent_name}")
                self._transfers.post(tracked, x)
