"""The pull engine: the decode side reads KV blocks from prefill engines (spec §4).

Flow of :meth:`PullEngine.start` for one request: choose the group-matched or
region-mapped path, expand ppl, align prefixes, compute descriptor ids
(:mod:`._readplan`); per source rank, split by (local kind, remote kind) with
``geometry.partition_by_mem_type``; post one READ per part **without** a notification; queue
``"{remote_request_id}:{consumers}"`` for each notified rank. :meth:`poll` /
:meth:`wait` drive the parts; the notifications go out only once every part of the request
is DONE (spec §4.6-§4.7). A request of exactly one READ (one source rank, one memory type
per side) carries its notification on that READ instead, as vLLM's single-type path does:
NIXL delivers it only after the READ completed. A full prefix hit only notifies.

Zeroing (spec §4.9, invariant §6.3.8): when the read leaves some of the request's local
descriptors unread (k > 1 tail sub-blocks, kernel blocks clipped by ppl rounding, positional
region-mapped padding), their byte ranges are computed at planning time
(``geometry.untransferred_ranges``) and zeroed by :meth:`LocalEngine.zero` in the same
completion step that sends the notifications, after them and before the request is
reported DONE: the producer's blocks are free to go as soon as every part is DONE, while
the caller must never see the request finished with stale bytes in its blocks. A failed
request is never zeroed: a READ whose status is an error may still be writing (spec §4.8).

Failures (spec §4.8): any exception while planning, preparing, posting or polling, or the
deadline passing, fails the request: no further part is posted, queued notifications are
dropped, handles are released (or held while NIXL refuses). ``start`` never raises for a
per-request problem; the failure comes back from :meth:`poll` / :meth:`wait` as a
:class:`~.errors.TransferFailure` with a :class:`~.errors.FailureCause`.

Threading: none of its own. NIXL is not assumed thread-safe, so call every method from one
thread (vLLM calls start_load_kv and get_finished from the worker thread).

Heartbeats: requests announced with :meth:`expect` and requests in flight are heartbeated
to their producer every ``lease_s / 6`` from :meth:`poll` (spec §1.8).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import geometry as geo
from ..resources import TRANSFER_TIMEOUT_S
from ._engine import PollResult, TransferEngine
from ._errors import (
    UnsupportedTransferError,
)
from ._heartbeat import HeartbeatSender
from ._local import LocalEngine
from ._notifications import completion_message
from ._parts import make_part
from ._peers import RemotePeer
from ._producer import DEFAULT_LEASE_S
from ._readplan import plan_read_ids
from ._remote import RemoteEngine
from ._route import ReadRoute, route_eligible

__all__ = ["DEFAULT_COALESCE", "PollResult", "PullEngine", "PullRequest"]

log = logging.getLogger(__name__)

#: Off: NIXL 1.5.1 merges adjacent prepared descriptors itself, so our merging measured no
#: gain (0.97-1.00x, see the package docstring for the numbers).
DEFAULT_COALESCE = False


class PullRequest(NamedTuple):
    """One request to read from a remote engine (a NamedTuple: immutable, and built once per
    request at a fraction of a frozen dataclass's cost).

    Attributes:
        request_id: this engine's id for the request (results are keyed by it).
        remote_engine_id: the producer engine (must have been added).
        local_block_ids: per transfer group, this engine's **logical** block ids.
        remote_block_ids: per transfer group, the producer's logical block ids.
        remote_request_id: the producer's id, used in notifications (default request_id).
        timeout_s: deadline for the whole read (default: the engine's).
        num_computed_blocks / remote_num_tokens: per-group local prefix hits (logical) and
            the producer's token count; when both are given, region-mapped reads pair pages
            by token position (spec §4.4 positional rule).
    """

    request_id: str
    remote_engine_id: str
    local_block_ids: Sequence[Sequence[int]]
    remote_block_ids: Sequence[Sequence[int]]
    remote_request_id: str | None = None
    timeout_s: float | None = None
    num_computed_blocks: Sequence[int] | None = None
    remote_num_tokens: int | None = None

    @property
    def notif_id(self) -> str:
        return self.remote_request_id or self.request_id


class PullEngine(TransferEngine):
    """Decode-side reader over one :class:`LocalEngine`.

    Args:
        local: this engine's registered memory and lists.
        timeout_s: default per-request deadline (every wait has one).
        coalesce: merge descriptors adjacent on both sides into one (see DEFAULT_COALESCE).
        lease_s: the producers' lease, for the heartbeat period.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        local: LocalEngine,
        *,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        coalesce: bool = DEFAULT_COALESCE,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(local, timeout_s=timeout_s, coalesce=coalesce, clock=clock,
                         on_terminal=self._terminal)
        self.heartbeats = HeartbeatSender(self.agent.send_notif, lease_s=lease_s, clock=clock)
        self._notif_ids: dict[str, str] = {}
        self._read_geo: dict[tuple[int, geo.TPMapping], tuple[np.ndarray, np.ndarray]] = {}
        self._mappings: dict[int, geo.TPMapping] = {}
        #: per remote engine: its ReadRoute, or None when its requests need the planner
        self._routes: dict[str, ReadRoute | None] = {}

    # -- peers ---------------------------------------------------------------------------
    def add_remote(self, desc: RemoteEngine) -> str:
        """Load a remote rank (after its handshake); replaces a stale entry. Returns the
        NIXL agent name."""
        old = self.peers.ranks(desc.engine_id).get(desc.tp_rank)
        if old is not None:
            self.heartbeats.forget_peer(old.agent_name)
        self._routes.pop(desc.engine_id, None)
        name = self.peers.add(desc).agent_name
        self._prepare(desc.engine_id)
        return name

    def remove_remote(self, engine_id: str, tp_rank: int | None = None) -> None:
        self._routes.pop(engine_id, None)
        for name in self.peers.remove(engine_id, tp_rank):
            self.heartbeats.forget_peer(name)

    def _prepare(self, engine_id: str) -> None:
        """Build the engine's route (its lists prepared) now, off the request path: the
        handshake or the operator's preflight pays for it, not the first request. A rank
        still missing (TP > 1) or a NIXL refusal leaves it to the first request, which
        then reports the problem as its own failure."""
        try:
            self._route(engine_id)
        except Exception as exc:
            self._routes.pop(engine_id, None)
            log.debug("route to %s not prepared yet: %s", engine_id, exc)

    def _route(self, engine_id: str) -> ReadRoute | None:
        """The cached route to ``engine_id``, or None if its requests need the planner."""
        if engine_id in self._routes:
            return self._routes[engine_id]
        local = self.local
        peer = self.peers.any_rank(engine_id)
        desc = peer.desc
        mapping = self._tp_mapping(desc.tp_size)
        route = None
        if route_eligible(
                local_group_ids=local.plan.group_ids.tolist(),
                remote_group_ids=desc.region_group_ids,
                local_block_size=local.facts.block_size, remote_block_size=desc.block_size,
                local_kinds=local.lists(1).index.mem_types, remote_kinds=peer.index.mem_types,
                source_ranks=len(mapping.source_ranks), notify_ranks=len(mapping.notify_ranks),
                split_reads=mapping.split_reads):
            source = self.peers.get(engine_id, mapping.source_ranks[0])
            (lkind, llist), = local.lists(1).by_kind.items()
            (rkind, rlist), = self._remote_lists(source, 1, mapping).items()
            route = ReadRoute(
                agent_name=source.agent_name, local_list=llist, remote_list=rlist,
                local_layout=local.desc_layout(1, False), remote_layout=source.layout(False),
                block_lens=local.plan.block_lens,
                local_ppl=local.facts.ppl, remote_ppl=source.desc.ppl,
                local_consumers=mapping.local_consumers,
                label=f"{lkind}<-{rkind}@{source.agent_name}")
        self._routes[engine_id] = route
        return route

    def expect(self, remote_request_id: str, remote_engine_id: str) -> None:
        """Heartbeat a request the producer holds for us before its read starts."""
        for peer in self.peers.ranks(remote_engine_id).values():
            self.heartbeats.track(peer.agent_name, remote_request_id)

    def _terminal(self, request_id: str) -> None:
        notif_id = self._notif_ids.pop(request_id, None)
        if notif_id is not None:
            self.heartbeats.untrack(notif_id)

    # -- requests ------------------------------------------------------------------------
    def start(self, req: PullRequest) -> None:
        """Plan and post the READs of ``req`` (the copy may finish inside this call).

        Raises:
            ValueError: ``req.request_id`` is already in flight.
        """
        self._track(req, self._start, "read")

    def _start(self, req: PullRequest, tracked: object) -> None:
        if not self.coalesce and self._start_routed(req, tracked):
            return
        self._notif_ids[req.request_id] = req.notif_id
        local = self.local
        any_peer = self.peers.any_rank(req.remote_engine_id)
        mapping = self._tp_mapping(any_peer.desc.tp_size)
        sources = [self.peers.get(req.remote_engine_id, r) for r in mapping.source_ranks]
        notify_only = [self.peers.get(req.remote_engine_id, r) for r in mapping.notify_ranks]
        message = completion_message(req.notif_id, mapping.local_consumers)
        for peer in (*sources, *notify_only):
            self.heartbeats.track(peer.agent_name, req.notif_id)

        if not any(len(g) for g in req.local_block_ids):      # full prefix hit: notify only
            for peer in (*sources, *notify_only):
                self._transfers.defer_notif(tracked, peer.agent_name, message)
            return

        ids = plan_read_ids(
            local.plan, local_block_size=local.facts.block_size, local_ppl=local.facts.ppl,
            remote=sources[0].desc, local_block_ids=req.local_block_ids,
            remote_block_ids=req.remote_block_ids,
            num_computed_blocks=req.num_computed_blocks,
            remote_num_tokens=req.remote_num_tokens, local_layout=local.desc_layout,
            remote_layout=sources[0].layout)
        if ids.region_mapped and len(sources) != 1:
            raise UnsupportedTransferError(
                f"region-mapped reads need exactly one source rank, the TP mapping gives "
                f"{list(mapping.source_ranks)}")
        if ids.allocated_ids is not None:
            ranges = geo.untransferred_ranges(local.plan, ids.allocated_ids, ids.local_ids,
                                              ids.k)
            if ranges:
                self._transfers.set_on_success(tracked, lambda: local.zero(ranges))
        split = mapping.split_reads
        # Plan every part of every source before posting anything.
        planned = []
        for i, peer in enumerate(sources):
            llists = local.lists(ids.k, split_reads=split, split_index=i if split > 1 else 0)
            rlists = self._remote_lists(peer, ids.k, mapping)
            parts = geo.partition_by_mem_type(ids.local_ids, ids.remote_ids,
                                              llists.index, peer.index)
            planned.append((peer, llists, rlists, parts))
        # One READ in all: the notification rides on it, as vLLM sends it (NIXL delivers it
        # only after the READ completed). Several parts: deferred until every part is done.
        single = len(planned) == 1 and len(planned[0][3]) == 1 and not notify_only
        for peer, llists, rlists, parts in planned:
            for part in parts:
                x = make_part(
                    self.agent, "READ",
                    llists.by_kind[part.local_mem_type], part.local_ids,
                    rlists[part.remote_mem_type], part.remote_ids,
                    coalesce=self.coalesce,
                    label=f"{req.request_id} {part.local_mem_type}<-{part.remote_mem_type}"
                          f"@{peer.agent_name}")
                # a raise stops all later parts
                self._transfers.post(tracked, x, message if single else b"")
            if not single:
                self._transfers.defer_notif(tracked, peer.agent_name, message)
        for peer in notify_only:
            self._transfers.defer_notif(tracked, peer.agent_name, message)

    def _start_routed(self, req: PullRequest, tracked: Any) -> bool:
        """Post ``req`` as one READ over its engine's cached route; False (nothing done)
        when the request needs the general planner (a full prefix hit among them)."""
        route = self._route(req.remote_engine_id)
        if route is None:
            return False
        ids = route.read_ids(req.local_block_ids, req.remote_block_ids)
        if ids is None or not ids[0].size:
            return False
        notif_id = req.notif_id
        message = completion_message(notif_id, route.local_consumers)
        x = self.agent.make_prepped("READ", route.local_list, ids[0], route.remote_list, ids[1],
                                    notif=message, label=f"{req.request_id} {route.label}",
                                    nbytes=ids[2])
        self._transfers.post(tracked, x, message, attached=True)
        if tracked.inflight:     # heartbeat it to the producer until it is done
            self._notif_ids[req.request_id] = notif_id
            self.heartbeats.track(route.agent_name, notif_id)
        return True

    def _tp_mapping(self, remote_tp: int) -> geo.TPMapping:
        """How this rank reads a remote engine of ``remote_tp`` ranks (pure; cached)."""
        got = self._mappings.get(remote_tp)
        if got is None:
            f = self.local.facts
            got = self._mappings[remote_tp] = geo.compute_tp_mapping(
                f.tp_rank, f.tp_size, remote_tp, is_mla=self.local.pure_mla)
        return got

    def _read_geometry(self, k: int, mapping: geo.TPMapping) -> tuple[np.ndarray, np.ndarray]:
        """Per-region read lengths and rank offsets for ratio ``k`` under ``mapping``."""
        key = (k, mapping)
        got = self._read_geo.get(key)
        if got is None:
            lens = self.local.plan.block_lens
            is_mla = self.local.plan.is_mla
            got = (np.array([mapping.read_len(int(lens[i]), is_mla[i], k)
                             for i in range(len(lens))], dtype=np.int64),
                   np.array([mapping.rank_offset(int(lens[i]), is_mla[i], k)
                             for i in range(len(lens))], dtype=np.int64))
            self._read_geo[key] = got
        return got

    def _remote_lists(self, peer: RemotePeer, k: int, mapping: geo.TPMapping) -> dict:
        read_lens, offsets = self._read_geometry(k, mapping)
        desc = peer.desc
        if desc.num_regions != read_lens.size:
            raise UnsupportedTransferError(
                f"remote {desc.engine_id!r} has {desc.num_regions} regions, local has "
                f"{read_lens.size}; P and D must have the same region count")
        key = ("read", k, mapping)
        return self.peers.lists(peer, key, lambda: geo.remote_descriptor_table(
            desc.base_addrs, desc.block_strides, desc.region_num_blocks, read_lens,
            desc.device_id, offsets))

    def poll(self) -> PollResult:
        """Non-blocking: advance every request; report those finished/failed since the last
        call (each exactly once). Also sends due heartbeats."""
        result = super().poll()
        self.heartbeats.tick()
        return result
