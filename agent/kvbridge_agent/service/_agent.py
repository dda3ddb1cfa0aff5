"""The agent facade (see the package docstring): its lifecycle and identity, the rest
delegated to the peers, the transfers and the receiver."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import rules
from ..geometry import CacheView, RegionPlan, plan_regions
from ..protocol import (
    CompatibilityFactors,
    EngineGeometry,
    NixlAgentMetadata,
    NixlHandshakePayload,
    compatibility_hash,
    make_payload,
)
from ._core import Core
from ._peers import ClockOffset, PeerSet
from ._receiver import Receiver
from ._requests import RequestBuilder
from ._transfers import Transfers
from ._types import (
    AgentSettings,
    EngineInfo,
    PeerRef,
    PeerReport,
    Side,
    TransferResult,
)

if TYPE_CHECKING:   # NIXL builds and ZMQ load when an agent starts, not at import
    from ..nixl import CompletionTracker, LocalEngine, NixlAgent, PullEngine, PushEngine
    from ..sidechannel import SideChannelServer

__all__ = ["AgentService"]

log = logging.getLogger("kvbridge.agent")


class AgentService:
    """One engine rank's agent; see the package docstring.

    Args:
        views: ``CacheView`` objects (or a ``RegionPlan``) of the KV caches to register.
        engine: see :class:`EngineInfo`.
        compat: the compatibility factors (hashed here) or a precomputed 64-hex hash.
        settings: see :class:`AgentSettings`.
        nixl: a loaded NIXL module (tests), default: whatever is installed.

    Use as a context manager or call :meth:`start` / :meth:`close`.
    """

    def __init__(
        self,
        views: Iterable[CacheView] | RegionPlan,
        engine: EngineInfo,
        compat: CompatibilityFactors | Mapping[str, Any] | str,
        settings: AgentSettings | None = None,
        *,
        nixl: Any = None,
    ) -> None:
        self.plan = views if isinstance(views, RegionPlan) else plan_regions(list(views))
        self.engine = engine
        self.side = Side.of(engine.role, engine.mode)
        self.settings = settings or AgentSettings()
        self.hash = compat if isinstance(compat, str) else compatibility_hash(compat)
        self.epoch = int(self.settings.epoch if self.settings.epoch is not None
                         else time.time() * 1000)
        self.agent_name = f"{engine.engine_id}-tp{engine.tp_rank}-e{self.epoch}"
        self._nixl = nixl
        self._core = Core(self.agent_name, engine, self.settings, self.side)
        self._peers = PeerSet(self._core, self.plan, self.hash, lambda: self.geometry)
        self._transfers = Transfers(self._core, self._peers)
        self._receiver = Receiver(self._core)
        self._requests = RequestBuilder(self.settings.transfer_timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.server: SideChannelServer | None = None
        self.metadata: NixlAgentMetadata | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> AgentService:
        from ..nixl import (
            PRODUCTION_MEM_TYPES,
            AgentConfig,
            CompletionTracker,
            LocalEngine,
            NixlAgent,
            PullEngine,
            PushEngine,
            UnsupportedTransferError,
        )
        from ..nixl import EngineFacts as LocalFacts
        from ..sidechannel import SideChannelServer

        e, s, c = self.engine, self.settings, self._core
        # vLLM's NixlPushConnector refuses at registration, on both sides (spec §5).
        if bad := rules.single_memory(self.plan.mem_types, mode=e.mode, producer=False,
                                      note=f"{e.role} {e.engine_id!r}; use mode pull or one "
                                      "memory type"):
            raise UnsupportedTransferError(bad.message)
        try:
            c.agent = NixlAgent(
                self.agent_name, AgentConfig(mem_types=s.mem_types or PRODUCTION_MEM_TYPES,
                                             num_threads=s.nixl_threads),
                nixl=self._nixl)
            c.local = LocalEngine(c.agent, self.plan, LocalFacts(
                e.engine_id, tp_rank=e.tp_rank, tp_size=e.tp_size, block_size=e.block_size,
                ppl=e.ppl, num_blocks=e.num_blocks, device_id=e.device_id))
            self.metadata = self._build_metadata(c.local)
            if self.side is Side.PULLER:
                c.mover = PullEngine(c.local, timeout_s=s.transfer_timeout_s)
            elif self.side is Side.PUSHER:
                c.mover = PushEngine(c.local, timeout_s=s.transfer_timeout_s)
            if not self.side.moves or s.producer_too:
                c.tracker = CompletionTracker(lease_s=s.lease_s,
                                              on_release=self._receiver.on_release)
            if s.serve_side_channel:
                self.server = SideChannelServer(
                    {(0, e.tp_rank): self.payload}, host=s.side_channel_host,
                    port=s.side_channel_port or 0,
                    dp_index=e.dp_index if s.side_channel_port else 0)
                self.server.start()
            self._peers.open()
            if s.progress_thread:
                self._thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                name=f"kvbridge-progress-{e.tp_rank}")
                self._thread.start()
        except BaseException:
            self.close()
            raise
        log.info("agent %s started: %d regions, side channel %s:%d", self.agent_name,
                 len(self.plan.regions), self.advertise_host, self.port)
        return self

    def __enter__(self) -> AgentService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the progress thread and the side channel, release NIXL (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop()
            self.server = None
        self._peers.close_client()
        c = self._core
        with c.lock:
            if c.mover is not None:
                with contextlib.suppress(Exception):
                    c.mover.close()
                c.mover = None
            if c.agent is not None:
                with contextlib.suppress(Exception):
                    c.agent.close()
                c.agent = None
            self._peers.forget_all()

    # -- identity ----------------------------------------------------------------------------
    @property
    def agent(self) -> NixlAgent | None:
        """The NIXL agent (None before :meth:`start` and after :meth:`close`)."""
        return self._core.agent

    @property
    def local(self) -> LocalEngine | None:
        return self._core.local

    @property
    def tracker(self) -> CompletionTracker | None:
        """The completion notifications of the other side (the waiting side only)."""
        return self._core.tracker

    @property
    def pull_engine(self) -> PullEngine | None:
        """A puller's PullEngine (None on the other sides)."""
        return self._core.mover if self.side is Side.PULLER else None

    @property
    def push_engine(self) -> PushEngine | None:
        """A pusher's PushEngine (None on the other sides)."""
        return self._core.mover if self.side is Side.PUSHER else None

    @property
    def notifications_received(self) -> int:
        """Completion notifications processed (decode in push mode, prefill in pull mode)."""
        return self._receiver.notifications_received

    @property
    def port(self) -> int:
        """The side-channel port peers connect to (ours, or the host engine's)."""
        if self.server is not None:
            return int(self.server.port)
        if not self.settings.serve_side_channel and self.settings.side_channel_port:
            return self.settings.side_channel_port + self.engine.dp_index
        return 0

    @property
    def payload(self) -> NixlHandshakePayload:
        """The v11 handshake payload (hash + metadata) for this rank, as served."""
        assert self.metadata is not None, "start() first"
        return make_payload(self.metadata, self.hash)

    @property
    def advertise_host(self) -> str:
        return self.settings.advertise_host or self.settings.side_channel_host

    @property
    def geometry(self) -> EngineGeometry:
        """This rank's geometry as ``validate_remote`` sees it (from the registered plan)."""
        assert self.metadata is not None, "start() first"
        e = self.engine
        return EngineGeometry.from_metadata(
            self.metadata, tp_size=e.tp_size, is_mla=e.is_mla, num_kv_heads=e.num_kv_heads,
            tp_rank=e.tp_rank, compatibility_hash=self.hash, transfer_mode=e.mode)

    def _build_metadata(self, local: LocalEngine) -> NixlAgentMetadata:
        d = local.describe()
        e = self.engine
        return NixlAgentMetadata(
            engine_id=e.engine_id, agent_metadata=d.agent_metadata,
            kv_caches_base_addr=list(d.base_addrs), device_id=e.device_id,
            num_blocks=d.num_blocks, block_lens=list(d.block_lens),
            block_strides=list(d.block_strides), kv_cache_layout=e.kv_cache_layout,
            block_size=e.block_size, ssm_sizes=(0, 0), attn_backend_name=e.attn_backend_name,
            physical_blocks_per_logical_kv_block=e.ppl,
            region_num_blocks=list(d.region_num_blocks),
            region_group_ids=list(d.region_group_ids),
            region_names=list(d.region_names or ()),
            region_mem_types=list(d.region_mem_types),
            dcp_size=e.dcp_size, pcp_size=e.pcp_size)

    # -- peers (flow 4 and 6) ----------------------------------------------------------------
    def peers(self) -> dict[str, PeerRef]:
        """Loaded peers by KVEndpoint name."""
        return self._peers.loaded()

    def reports(self) -> list[PeerReport]:
        """Latest handshake report per assigned peer (what ``status.handshakes`` shows)."""
        return self._peers.reports()

    def set_peers(self, assigned: Iterable[PeerRef | Mapping[str, Any]]) -> list[PeerReport]:
        """Make the loaded peers equal ``assigned``: drop the others (and peers whose epoch
        changed), handshake with the new ones. Returns the reports of all assigned peers.
        A peer already loaded at the same epoch is not handshaken again; a failed one is
        retried on every call."""
        return self._peers.assign(assigned)

    def handshake(self, ref: PeerRef) -> PeerReport:
        """Fetch ``ref``'s v11 metadata, validate it and load it into NIXL. Never raises for
        a peer problem: the report says what went wrong (and metrics count it)."""
        return self._peers.handshake(ref)

    def has_remote(self, engine_id: str) -> bool:
        """Whether some rank of ``engine_id`` is loaded (handshaken)."""
        return self._peers.has_remote(engine_id)

    def loaded_since(self, engine_id: str) -> float | None:
        """When the latest-loaded rank of ``engine_id`` was loaded (``time.monotonic``);
        None when none is. Changes with every new handshake, whoever started it (this
        engine, the operator's peer assignment after an epoch change)."""
        return self._peers.loaded_since(engine_id)

    def clock_offset(self, engine_id: str) -> ClockOffset | None:
        """``engine_id``'s clock against ours, measured by its handshake (the loaded rank
        with the smallest error); None when no rank is loaded. Converts the lease deadline
        a prefill states on its clock (``remote_blocks_expiry_time``) to ours."""
        return self._peers.clock_offset(engine_id)

    def drop_remote(self, engine_id: str, why: str) -> None:
        """Unload every rank of ``engine_id`` (after a failed transfer, for instance): the
        next request handshakes again and meets whatever agent serves there now."""
        self._peers.drop_remote(engine_id, why)

    def send_heartbeat(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """Extend the leases a producer holds for us (a heartbeat notification to each
        loaded rank of ``engine_id``). A rank that cannot be reached is dropped, so the next
        request handshakes again instead of reading from a dead agent; its lease decides
        the rest."""
        self._peers.send_heartbeat(engine_id, request_ids)

    # -- transfers (flow 5) ------------------------------------------------------------------
    def pull(
        self,
        request_id: str,
        remote_engine_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
        *,
        remote_request_id: str | None = None,
        expected_epoch: int | None = None,
        timeout_s: float | None = None,
    ) -> TransferResult:
        """Read blocks from a preflighted prefill engine; blocks until done or the deadline.

        Never handshakes: a peer that is not loaded fails with cause ``unknown_remote``; with
        ``expected_epoch`` a peer loaded at another epoch fails with cause ``stale_peer``
        (nothing is posted). Failures never send the completion notification.
        """
        self._transfers.mover_for("pull", Side.PULLER)
        req = self._requests.pull(request_id, remote_engine_id, local_block_ids,
                                  remote_block_ids, remote_request_id=remote_request_id,
                                  timeout_s=timeout_s)
        return self._transfers.run(req, expected_epoch, req.timeout_s)

    def start_pull(
        self,
        request_id: str,
        remote_engine_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
        *,
        remote_request_id: str | None = None,
        num_computed_blocks: Sequence[int] | None = None,
        remote_num_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Post the READs of a pull and return at once (an engine's step loop cannot
        block); the outcome comes from :meth:`take_pull_results`, exactly once. Like
        :meth:`pull`, never handshakes, and a failure never notifies the producer."""
        self._transfers.start(self._requests.pull(
            request_id, remote_engine_id, local_block_ids, remote_block_ids,
            remote_request_id=remote_request_id, timeout_s=timeout_s,
            num_computed_blocks=num_computed_blocks, remote_num_tokens=remote_num_tokens))

    def take_pull_results(self) -> list[TransferResult]:
        """Pulls started by :meth:`start_pull` that ended (finished or failed) as of the last
        poll (:meth:`progress`, or the progress thread's), each reported once."""
        return self._transfers.take_results()

    def push(
        self,
        request_id: str,
        remote_engine_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
        *,
        expected_epoch: int | None = None,
        timeout_s: float | None = None,
    ) -> TransferResult:
        """Write this prefill engine's blocks into a preflighted decode engine (spec §5);
        blocks until every WRITE is done or the deadline.

        ``request_id`` is the id the decode side expects (:meth:`expect`); the completion
        notification ``"{request_id}:{consumers}"`` travels with each WRITE, so the decode
        side learns of it only after the bytes are in place. ``remote_block_ids`` are the
        decode side's block ids (per group), ``local_block_ids`` this engine's. Never
        handshakes; ``unknown_remote`` / ``stale_peer`` as in :meth:`pull`. A failed WRITE
        never delivers the notification.
        """
        self._transfers.mover_for("push", Side.PUSHER)
        req = self._requests.push(request_id, remote_engine_id, local_block_ids,
                                  remote_block_ids, timeout_s=timeout_s)
        return self._transfers.run(req, expected_epoch, req.timeout_s)

    # -- the waiting side (flow 5) -----------------------------------------------------------
    def hold(self, request_ids: Iterable[str], lease_s: float | None = None) -> None:
        """Pull-mode producer side: hold blocks of these requests until consumers notify
        completion (or the lease expires)."""
        self._receiver.hold(request_ids, lease_s)

    def unhold(self, request_ids: Iterable[str]) -> None:
        """Stop holding requests that were aborted (never reported as finished)."""
        self._receiver.unhold(request_ids)

    def set_lease(self, request_id: str, lease_s: float) -> None:
        """Set a held request's lease to end ``lease_s`` from now (notifications counted
        so far are kept)."""
        self._receiver.set_lease(request_id, lease_s)

    def expect(self, request_id: str, local_block_ids: Sequence[Sequence[int]], *,
               lease_s: float | None = None) -> None:
        """Push-mode decode side: expect ``request_id`` to be written into these local blocks
        (per group, logical ids; what the router hands the prefill side as its
        ``remote_block_ids``). The ids are checked against the registered regions now
        (``geometry.GeometryError``). The request completes when the prefill's WRITE
        notifications arrive (:meth:`wait_received`, :meth:`completions`); without them it
        expires after ``lease_s`` (default: ``nixl.DEFAULT_LEASE_S``)."""
        self._receiver.expect(request_id, local_block_ids, lease_s)

    def wait_received(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Push-mode decode side: block until the prefill's WRITE of ``request_id`` has
        completed (its notification count reached), the request's lease expired (cause
        ``expired``) or ``timeout_s`` passed (cause ``timeout``; the request stays expected).
        """
        return self._receiver.wait_received(request_id, self._requests.timeout(timeout_s),
                                            self._poll_locked)

    def completions(self, *, poll: bool = True) -> dict[str, list[str]]:
        """The waiting side (prefill in pull mode, decode in push mode): requests completed
        or expired since the last call (``poll=False``: right after :meth:`progress`)."""
        if self._core.tracker is None:       # set once at start: no lock needed to read it
            return {"finished": [], "expired": []}
        with self._core.lock:
            if poll:
                self._poll_locked()
            return self._receiver.take_completions()

    # -- progress ----------------------------------------------------------------------------
    def progress(self) -> None:
        """Advance transfers, notifications and leases once (what the progress thread does;
        a host engine without it calls this every step)."""
        with self._core.lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        if self._core.agent is None:
            return
        self._transfers.poll_locked()
        self._receiver.poll_locked()

    def _progress_loop(self) -> None:
        interval = self.settings.progress_interval_s
        while not self._stop.wait(interval):
            try:
                with self._core.lock:
                    self._poll_locked()
            except Exception as exc:   # keep serving; a transfer reports its own failure
                log.warning("agent %s: progress poll failed: %s", self.agent_name, exc)
