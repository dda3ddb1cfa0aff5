"""The agent orchestrator (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import metrics, rules
from ..geometry import CacheView, RegionPlan, plan_regions
from ..nixl import PullRequest, PushRequest, TransferFailure  # no NIXL build loads here
from ..protocol import (
    NIXL_CONNECTOR_VERSION,
    CompatibilityFactors,
    EngineGeometry,
    NixlAgentMetadata,
    NixlHandshakePayload,
    ProtocolError,
    check_metadata,
    compatibility_hash,
    make_payload,
    validate_remote,
)
from ._types import (
    DECODE,
    AgentClosedError,
    AgentSettings,
    EngineInfo,
    HandshakeOutcome,
    PeerRef,
    PeerReport,
    Side,
    StalePeerError,
    TransferResult,
    UnknownRequestError,
    WrongSideError,
    utc_timestamp,
)

if TYPE_CHECKING:   # NIXL builds and ZMQ load when an agent starts, not at import
    from ..nixl import (
        CompletionTracker,
        LocalEngine,
        NixlAgent,
        PullEngine,
        PushEngine,
        TransferDone,
    )
    from ..protocol import Verdict
    from ..sidechannel import SideChannelClient, SideChannelServer

__all__ = ["AgentService"]

log = logging.getLogger("kvbridge.agent")



@dataclass
class _Peer:
    ref: PeerRef
    agent_name: str
    loaded_at: float = field(default_factory=time.monotonic)


class AgentService:
    """One engine rank's agent; see the module docstring.

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
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._reports: dict[str, PeerReport] = {}
        self._results: dict[str, TransferDone | TransferFailure] = {}
        self._started: dict[str, float] = {}
        self._expected: dict[str, list[list[int]]] = {}   # decode, push: rid -> local ids
        self._released: dict[str, str] = {}               # rid -> ReleaseReason, for waiters
        self._async: set[str] = set()                      # pulls started by start_pull
        #: completion notifications processed (decode in push mode, prefill in pull mode)
        self.notifications_received = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: SideChannelClient | None = None
        self.agent: NixlAgent | None = None
        self.local: LocalEngine | None = None
        #: the engine that moves bytes (a puller's PullEngine, a pusher's PushEngine)
        self._mover: PullEngine | PushEngine | None = None
        #: completion notifications of the other side (a receiver, or kv_both's producer)
        self.tracker: CompletionTracker | None = None
        self.server: SideChannelServer | None = None
        self.metadata: NixlAgentMetadata | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> AgentService:
        from ..nixl import (
            PRODUCTION_MEM_TYPES,
            AgentConfig,
            CompletionTracker,
            EngineFacts,
            LocalEngine,
            NixlAgent,
            PullEngine,
            PushEngine,
            UnsupportedTransferError,
        )
        from ..sidechannel import SideChannelClient, SideChannelServer

        e, s = self.engine, self.settings
        # vLLM's NixlPushConnector refuses at registration, on both sides (spec §5).
        if bad := rules.single_memory(self.plan.mem_types, mode=e.mode, producer=False,
                                      note=f"{e.role} {e.engine_id!r}; use mode pull or one "
                                      "memory type"):
            raise UnsupportedTransferError(bad.message)
        try:
            self.agent = NixlAgent(
                self.agent_name, AgentConfig(mem_types=s.mem_types or PRODUCTION_MEM_TYPES,
                                             num_threads=s.nixl_threads),
                nixl=self._nixl)
            self.local = LocalEngine(self.agent, self.plan, EngineFacts(
                e.engine_id, tp_rank=e.tp_rank, tp_size=e.tp_size, block_size=e.block_size,
                ppl=e.ppl, num_blocks=e.num_blocks, device_id=e.device_id))
            self.metadata = self._build_metadata()
            if self.side is Side.PULLER:
                self._mover = PullEngine(self.local, timeout_s=s.transfer_timeout_s)
            elif self.side is Side.PUSHER:
                self._mover = PushEngine(self.local, timeout_s=s.transfer_timeout_s)
            if not self.side.moves or s.producer_too:
                self.tracker = CompletionTracker(on_release=self._on_release)
            if s.serve_side_channel:
                self.server = SideChannelServer(
                    {(0, e.tp_rank): self.payload}, host=s.side_channel_host,
                    port=s.side_channel_port or 0,
                    dp_index=e.dp_index if s.side_channel_port else 0)
                self.server.start()
            self._client = SideChannelClient()
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
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._lock:
            if self._mover is not None:
                with contextlib.suppress(Exception):
                    self._mover.close()
                self._mover = None
            if self.agent is not None:
                with contextlib.suppress(Exception):
                    self.agent.close()
                self.agent = None
            self._peers.clear()
            metrics.PEERS.set(0)

    # -- identity ----------------------------------------------------------------------------
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

    def _build_metadata(self) -> NixlAgentMetadata:
        d = self.local.describe()
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

    def endpoint_spec(self, *, transfer: str, pod_name: str, pod_uid: str = "",
                      node_name: str = "") -> dict[str, Any]:
        """The KVEndpoint ``spec`` for this registration (flow 2)."""
        assert self.metadata is not None, "start() first"
        e, m = self.engine, self.metadata
        regions = [
            {"name": name, "numBlocks": int(nb), "groupId": int(g), "memType": mt,
             "blockLen": int(bl), "blockStride": int(bs)}
            for name, nb, g, mt, bl, bs in zip(
                m.region_names or (), m.region_num_blocks or (), m.region_group_ids or (),
                m.region_mem_types or (), m.block_lens, m.block_strides, strict=True)
        ]
        geometry: dict[str, Any] = {
            "blockSize": e.block_size, "physicalBlocksPerLogical": e.ppl,
            "numBlocks": int(m.num_blocks), "kvCacheLayout": e.kv_cache_layout,
            "attentionBackend": e.attn_backend_name, "isMla": e.is_mla,
            "dcpSize": e.dcp_size, "pcpSize": e.pcp_size, "regions": regions,
        }
        if e.num_kv_heads is not None:
            geometry["numKvHeads"] = e.num_kv_heads
        spec: dict[str, Any] = {
            "transferName": transfer, "role": e.role, "engineId": e.engine_id,
            "podName": pod_name, "sideChannel": {"host": self.advertise_host, "port": self.port},
            "tpRank": e.tp_rank, "tpSize": e.tp_size, "dpIndex": e.dp_index,
            "protocolVersion": NIXL_CONNECTOR_VERSION, "compatibilityHash": self.hash,
            "mode": e.mode, "epoch": self.epoch, "geometry": geometry,
        }
        if pod_uid:
            spec["podUID"] = pod_uid
        if node_name:
            spec["nodeName"] = node_name
        return spec

    # -- peers (flow 4 and 6) ----------------------------------------------------------------
    def peers(self) -> dict[str, PeerRef]:
        """Loaded peers by KVEndpoint name."""
        with self._lock:
            return {p.ref.name: p.ref for p in self._peers.values()}

    def reports(self) -> list[PeerReport]:
        """Latest handshake report per assigned peer (what ``status.handshakes`` shows)."""
        with self._lock:
            return sorted(self._reports.values(), key=lambda r: r.peer)

    def set_peers(self, assigned: Iterable[PeerRef | Mapping[str, Any]]) -> list[PeerReport]:
        """Make the loaded peers equal ``assigned``: drop the others (and peers whose epoch
        changed), handshake with the new ones. Returns the reports of all assigned peers.
        A peer already loaded at the same epoch is not handshaken again; a failed one is
        retried on every call."""
        refs = [a if isinstance(a, PeerRef) else PeerRef.from_status(a) for a in assigned]
        want = {r.key: r for r in refs}
        with self._lock:
            for key, peer in list(self._peers.items()):
                new = want.get(key)
                if new is None or new.epoch != peer.ref.epoch or new.name != peer.ref.name:
                    self._drop(key, "went away" if new is None else
                               f"epoch {peer.ref.epoch} -> {new.epoch}")
            todo = [r for r in refs if r.key not in self._peers]
            names = {r.name for r in refs}
            for gone in set(self._reports) - names:
                del self._reports[gone]
        for ref in todo:
            report = self.handshake(ref)
            with self._lock:
                self._reports[ref.name] = report
        return self.reports()

    def _drop(self, key: tuple[str, int], why: str) -> None:
        peer = self._peers.pop(key)
        log.info("agent %s: dropping peer %s (%s, NIXL agent %s): %s", self.agent_name,
                 peer.ref.name, peer.ref.engine_id, peer.agent_name, why)
        try:
            if self._mover is not None:
                self._mover.remove_remote(peer.ref.engine_id, peer.ref.tp_rank)
            elif self.agent is not None:
                self.agent.remove_remote(peer.agent_name)
        except Exception as exc:  # the peer may be dead; removal is best effort
            log.warning("removing NIXL remote %s failed: %s", peer.agent_name, exc)
        metrics.PEERS.set(len(self._peers))

    @property
    def pull_engine(self) -> PullEngine | None:
        """A puller's PullEngine (None on the other sides)."""
        return self._mover if self.side is Side.PULLER else None

    @property
    def push_engine(self) -> PushEngine | None:
        """A pusher's PushEngine (None on the other sides)."""
        return self._mover if self.side is Side.PUSHER else None

    def handshake(self, ref: PeerRef) -> PeerReport:
        """Fetch ``ref``'s v11 metadata, validate it and load it into NIXL. Never raises for
        a peer problem: the report says what went wrong (and metrics count it)."""
        from ..nixl import RemoteEngine, UnsupportedTransferError
        from ..sidechannel import HandshakeTimeoutError, RemoteRejectedError, SideChannelError

        started = time.perf_counter()
        result, message, agent_name = HandshakeOutcome.ERROR, "", ""
        try:
            if self._client is None:
                raise AgentClosedError(f"agent {self.agent_name} is not started or closed")
            got = self._client.fetch(
                ref.host, ref.port, [(0, ref.tp_rank)],
                timeout_s=self.settings.handshake_timeout_s, local_hash=self.hash,
                enforce_handshake_compat=self.settings.enforce_hash,
                expected_engine_id=ref.engine_id)
            meta = got.metadata(0, ref.tp_rank)
            verdict = self._validate(meta, ref)
            if not verdict.ok:
                result, message = HandshakeOutcome.INCOMPATIBLE, verdict.summary(limit=5)
            else:
                with self._lock:
                    if self.agent is None:
                        raise AgentClosedError(f"agent {self.agent_name} closed")
                    if self._mover is not None:
                        desc = RemoteEngine.from_metadata(
                            meta, tp_rank=ref.tp_rank, tp_size=ref.tp_size,
                            local_region_group_ids=self.plan.group_ids,
                            local_mem_type=self.plan.mem_types[0])
                        agent_name = self._mover.add_remote(desc)
                    else:
                        if ref.key in self._peers:
                            self._drop(ref.key, "re-handshake")
                        agent_name = self.agent.add_remote(bytes(meta.agent_metadata))
                    if ref.epoch is not None and not agent_name.endswith(f"-e{ref.epoch}"):
                        self._unload(ref, agent_name)
                        raise StalePeerError(
                            f"side channel {ref.host}:{ref.port} answered with NIXL agent "
                            f"{agent_name!r}, not the assigned epoch {ref.epoch}")
                    self._peers[ref.key] = _Peer(ref, agent_name)
                    metrics.PEERS.set(len(self._peers))
                result = HandshakeOutcome.SUCCEEDED
        except HandshakeTimeoutError as exc:
            result, message = HandshakeOutcome.TIMEOUT, str(exc)
        except RemoteRejectedError as exc:
            result, message = HandshakeOutcome.REJECTED, str(exc)
        except StalePeerError as exc:
            result, message = HandshakeOutcome.STALE, str(exc)
        except (ProtocolError, UnsupportedTransferError) as exc:
            result, message = HandshakeOutcome.INCOMPATIBLE, f"{type(exc).__name__}: {exc}"
        except (SideChannelError, Exception) as exc:
            result, message = HandshakeOutcome.ERROR, f"{type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - started
        metrics.HANDSHAKES.labels(result.value).inc()
        metrics.HANDSHAKE_SECONDS.observe(elapsed)
        ok = result is HandshakeOutcome.SUCCEEDED
        (log.info if ok else log.warning)(
            "agent %s: handshake with %s (%s rank %d epoch %s at %s:%d): %s%s",
            self.agent_name, ref.name, ref.engine_id, ref.tp_rank, ref.epoch, ref.host,
            ref.port, result, f": {message}" if message else "")
        return PeerReport(ref.name, ref.engine_id, ref.epoch, ok, message, result, utc_timestamp(),
                          agent_name)

    def _unload(self, ref: PeerRef, agent_name: str) -> None:
        with contextlib.suppress(Exception):
            if self._mover is not None:
                self._mover.remove_remote(ref.engine_id, ref.tp_rank)
            elif self.agent is not None:
                self.agent.remove_remote(agent_name)

    def _validate(self, meta: NixlAgentMetadata, ref: PeerRef) -> Verdict:
        broken = check_metadata(meta)   # a peer inconsistent with itself, whatever we are
        if not broken.ok:
            return broken
        e = self.engine
        remote = EngineGeometry.from_metadata(
            meta, tp_size=ref.tp_size, is_mla=e.is_mla, num_kv_heads=e.num_kv_heads,
            tp_rank=ref.tp_rank, compatibility_hash=self.hash, transfer_mode=e.mode)
        if e.role == DECODE:   # local = D, remote = P (the orientation of validate_remote)
            return validate_remote(self.geometry, remote, mode=e.mode,
                                   expected_engine_id=ref.engine_id,
                                   expected_tp_size=ref.tp_size)
        return validate_remote(replace(remote, engine_id=remote.engine_id), self.geometry,
                               mode=e.mode)

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
        self._mover_for("pull", Side.PULLER)
        req = PullRequest(request_id, remote_engine_id, local_block_ids, remote_block_ids,
                          remote_request_id, self._timeout(timeout_s))
        return self._transfer(req, expected_epoch, req.timeout_s)

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
        req = PullRequest(request_id, remote_engine_id, local_block_ids, remote_block_ids,
                          remote_request_id, self._timeout(timeout_s), num_computed_blocks,
                          remote_num_tokens)
        with self._lock:
            mover = self._mover_for("start_pull", Side.PULLER)
            self._async.add(request_id)
            self._started[request_id] = time.perf_counter()
            mover.start(req)

    def take_pull_results(self) -> list[TransferResult]:
        """Pulls started by :meth:`start_pull` that ended (finished or failed) as of the last
        poll (:meth:`progress`, or the progress thread's), each reported once."""
        out: list[TransferResult] = []
        if not self._results:      # the common step: nothing ended (a racy read only delays)
            return out
        with self._lock:
            for rid in [r for r in self._async if r in self._results]:
                self._async.discard(rid)
                seconds = time.perf_counter() - self._started.pop(rid, time.perf_counter())
                out.append(self._outcome(rid, self._results.pop(rid), seconds))
        return out

    def _timeout(self, timeout_s: float | None) -> float:
        """A request's deadline: the settings' unless one is given."""
        return self.settings.transfer_timeout_s if timeout_s is None else float(timeout_s)

    def has_remote(self, engine_id: str) -> bool:
        """Whether some rank of ``engine_id`` is loaded (handshaken)."""
        with self._lock:
            return any(k[0] == engine_id for k in self._peers)

    def drop_remote(self, engine_id: str, why: str) -> None:
        """Unload every rank of ``engine_id`` (after a failed transfer, for instance): the
        next request handshakes again and meets whatever agent serves there now."""
        with self._lock:
            for key in [k for k in self._peers if k[0] == engine_id]:
                self._drop(key, why)

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
        self._mover_for("push", Side.PUSHER)
        timeout = self._timeout(timeout_s)
        return self._transfer(PushRequest(
            request_id=request_id, remote_engine_id=remote_engine_id,
            local_block_ids=local_block_ids, remote_block_ids=remote_block_ids,
            timeout_s=timeout), expected_epoch, timeout)

    def _mover_for(self, what: str, side: Side) -> PullEngine | PushEngine:
        """This agent's mover, when ``what`` is a call of ``side``; else WrongSideError."""
        if self.side is not side:
            need = "a decode agent in pull mode" if side is Side.PULLER else (
                "a prefill agent in push mode")
            raise WrongSideError(f"agent {self.agent_name}: {what} needs {need}; this agent "
                                 f"is a {self.side.value} ({self.engine.role}, "
                                 f"{self.engine.mode} mode)")
        if self._mover is None:
            raise AgentClosedError(f"agent {self.agent_name} is not started or closed")
        return self._mover

    def _transfer(self, req: PullRequest | PushRequest, expected_epoch: int | None,
                  timeout: float) -> TransferResult:
        request_id, remote_engine_id = req.request_id, req.remote_engine_id
        with self._lock:
            engine = self._mover
            if engine is None:
                raise AgentClosedError(f"agent {self.agent_name} is not started or closed")
            ranks = [p for k, p in self._peers.items() if k[0] == remote_engine_id]
            if expected_epoch is not None and any(p.ref.epoch != expected_epoch for p in ranks):
                return self._failed(request_id, "stale_peer",
                                    f"remote {remote_engine_id!r} is loaded at epoch "
                                    f"{sorted({p.ref.epoch for p in ranks})}, request expects "
                                    f"{expected_epoch}")
            started = time.perf_counter()
            engine.start(req)
            self._started[request_id] = started
            deadline = time.monotonic() + timeout + 5.0   # the engine's own deadline is first
            while request_id not in self._results:
                self._poll_locked()
                if request_id in self._results:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._failed(request_id, "timeout", "no result before the deadline")
                self._cond.wait(timeout=min(left, 0.002))
            res = self._results.pop(request_id)
            seconds = time.perf_counter() - self._started.pop(request_id, started)
        return self._outcome(request_id, res, seconds)

    def _outcome(self, request_id: str, res: TransferDone | TransferFailure,
                 seconds: float) -> TransferResult:
        """An engine's ``TransferDone`` / ``TransferFailure`` as a counted ``TransferResult``."""
        if isinstance(res, TransferFailure):
            return self._failed(request_id, res.cause.value, res.message)
        metrics.TALLY.add(res.nbytes, res.descs, seconds)
        return TransferResult(request_id, True, res.nbytes, res.descs, res.parts, seconds)

    @staticmethod
    def _failed(request_id: str, cause: str, message: str) -> TransferResult:
        metrics.TRANSFER_FAILURES.labels(cause).inc()
        log.warning("transfer %s failed (%s): %s", request_id, cause, message)
        return TransferResult(request_id, False, cause=cause, message=message)

    def _waiting_side(self, what: str) -> CompletionTracker:
        if self.tracker is None:
            e = self.engine
            raise WrongSideError(
                f"agent {self.agent_name}: {what} is for the side that waits for completion "
                f"notifications (prefill in pull mode, decode in push mode), not a {e.role} "
                f"agent in {e.mode} mode")
        return self.tracker

    def hold(self, request_ids: Iterable[str], lease_s: float | None = None) -> None:
        """Pull-mode producer side: hold blocks of these requests until consumers notify
        completion (or the lease expires)."""
        with self._lock:
            tracker = self._waiting_side("hold")
            for rid in request_ids:
                tracker.register(rid, lease_s=lease_s)

    def unhold(self, request_ids: Iterable[str]) -> None:
        """Stop holding requests that were aborted (never reported as finished)."""
        with self._lock:
            tracker = self._waiting_side("unhold")
            for rid in request_ids:
                tracker.forget(rid)

    def set_lease(self, request_id: str, lease_s: float) -> None:
        """Set a held request's lease to end ``lease_s`` from now (notifications counted
        so far are kept)."""
        with self._lock:
            self._waiting_side("set_lease").set_lease(request_id, lease_s)

    def send_heartbeat(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """Extend the leases a producer holds for us (``"HB:id,..."`` to each loaded rank
        of ``engine_id``). A rank that cannot be reached is dropped, so the next request
        handshakes again instead of reading from a dead agent; its lease decides the rest."""
        from ..nixl import heartbeat_message

        if not request_ids:
            return
        message = heartbeat_message(list(request_ids))
        with self._lock:
            for key, peer in list(self._peers.items()):
                if key[0] != engine_id or self.agent is None:
                    continue
                try:
                    self.agent.send_notif(peer.agent_name, message)
                except Exception as exc:   # a dead agent: the next request handshakes again
                    log.warning("heartbeat to %s failed: %s", peer.agent_name, exc)
                    self._drop(key, f"heartbeat failed: {exc}")

    def expect(self, request_id: str, local_block_ids: Sequence[Sequence[int]], *,
               lease_s: float | None = None) -> None:
        """Push-mode decode side: expect ``request_id`` to be written into these local blocks
        (per group, logical ids; what the router hands the prefill side as its
        ``remote_block_ids``). The ids are checked against the registered regions now
        (``geometry.GeometryError``). The request completes when the prefill's WRITE
        notifications arrive (:meth:`wait_received`, :meth:`completions`); without them it
        expires after ``lease_s`` (default 30 s)."""
        from ..geometry import expand_logical_to_kernel

        if self.side is not Side.RECEIVER or self.engine.role != DECODE:
            raise WrongSideError(f"agent {self.agent_name}: expect needs a decode agent in "
                                 "push mode")
        if self.local is None:
            raise AgentClosedError(f"agent {self.agent_name} is not started or closed")
        ids = [[int(b) for b in g] for g in local_block_ids]
        self.local.desc_layout(1, False).desc_ids(
            [expand_logical_to_kernel(g, self.engine.ppl) for g in ids])
        with self._lock:
            tracker = self._waiting_side("expect")
            self._released.pop(request_id, None)
            self._expected[request_id] = ids
            tracker.register(request_id, lease_s=lease_s)

    def wait_received(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Push-mode decode side: block until the prefill's WRITE of ``request_id`` has
        completed (its notification count reached), the request's lease expired (cause
        ``expired``) or ``timeout_s`` passed (cause ``timeout``; the request stays expected).
        """
        timeout = self._timeout(timeout_s)
        deadline = time.monotonic() + timeout
        with self._lock:
            tracker = self._waiting_side("wait_received")
            if request_id not in self._expected:
                raise UnknownRequestError(
                    f"request {request_id!r} is not expected (see expect())")
            while request_id not in self._released:
                self._poll_locked()
                if request_id in self._released:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return TransferResult(
                        request_id, False, cause="timeout",
                        message=f"no completion notification within {timeout} s "
                                f"({tracker.received(request_id)} received)")
                self._cond.wait(timeout=min(left, 0.002))
            reason = self._released.pop(request_id)
            self._expected.pop(request_id, None)
        if reason == "completed":
            return TransferResult(request_id, True)
        return TransferResult(request_id, False, cause="expired",
                              message="the lease expired before the completion notification")

    def _on_release(self, request_id: str, reason: str) -> None:
        if request_id in self._expected:   # only what a waiter may still ask for
            self._released[request_id] = reason
            self._cond.notify_all()

    def completions(self, *, poll: bool = True) -> dict[str, list[str]]:
        """The waiting side (prefill in pull mode, decode in push mode): requests completed
        or expired since the last call (``poll=False``: right after :meth:`progress`)."""
        if self.tracker is None:       # set once at start: no lock needed to read it
            return {"finished": [], "expired": []}
        with self._lock:
            if poll:
                self._poll_locked()
            finished = sorted(self.tracker.take_finished())
            expired = sorted(self.tracker.take_expired())
            for rid in (*finished, *expired):
                self._expected.pop(rid, None)
                self._released.pop(rid, None)
            return {"finished": finished, "expired": expired}

    # -- progress ----------------------------------------------------------------------------
    def progress(self) -> None:
        """Advance transfers, notifications and leases once (what the progress thread does;
        a host engine without it calls this every step)."""
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        if self.agent is None:
            return
        if self._mover is not None:
            res = self._mover.poll()
            for r in (*res.finished, *res.failed):
                self._results[r.request_id] = r
            if res.finished or res.failed:
                self._cond.notify_all()
        if self.tracker is not None:
            notifs = self.agent.get_notifs()
            self.notifications_received += sum(
                1 for msgs in notifs.values() for m in msgs if not bytes(m).startswith(b"HB:"))
            self.tracker.process(notifs)
            self.tracker.expire()

    def _progress_loop(self) -> None:
        interval = self.settings.progress_interval_s
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    self._poll_locked()
            except Exception as exc:   # keep serving; a transfer reports its own failure
                log.warning("agent %s: progress poll failed: %s", self.agent_name, exc)
