"""The agent's peers: the assigned set, their handshakes and their removal (flows 4, 6).

A handshake is three steps: fetch the v11 payload over the side channel (without the lock),
validate it against this rank, load it into NIXL (under :attr:`Core.lock`; lock order:
``_core``). Whoever moves the bytes loads the peer's memory description into its mover; a
receiver loads only the peer's NIXL agent. A peer problem never raises: it becomes a
:class:`PeerReport` with a :class:`HandshakeOutcome`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import metrics
from ..geometry import RegionPlan
from ..protocol import (
    EngineGeometry,
    NixlAgentMetadata,
    ProtocolError,
    check_metadata,
    validate_remote,
)
from ._core import Core
from ._types import (
    DECODE,
    AgentClosedError,
    HandshakeOutcome,
    PeerRef,
    PeerReport,
    StalePeerError,
    utc_timestamp,
)

if TYPE_CHECKING:
    from ..nixl import PeerTransport
    from ..protocol import Verdict
    from ..sidechannel import SideChannelClient

__all__ = ["ClockOffset", "PeerSet"]

log = logging.getLogger("kvbridge.agent")


@dataclass(frozen=True)
class ClockOffset:
    """A peer's clock against ours, from the lowest-RTT handshake sample (spec §1.1):
    ``remote_perf_counter - local_perf_counter``, known to within ``error_s`` (half that
    sample's round trip). A producer's lease deadlines are on its clock."""

    offset_s: float
    error_s: float

    def to_local(self, remote_time: float) -> float:
        """``remote_time`` (the peer's ``perf_counter``) on this process's clock."""
        return remote_time - self.offset_s


@dataclass
class _Peer:
    ref: PeerRef
    agent_name: str
    clock: ClockOffset | None = None
    transport: PeerTransport | None = None
    loaded_at: float = field(default_factory=time.monotonic)


class PeerSet:
    """The loaded peers by ``(engine_id, tp_rank)`` and the latest report per assigned peer.

    Args:
        core: the agent's shared lock and NIXL handles.
        plan: this rank's registered regions (a mover maps the peer's onto them).
        compat_hash: this rank's compatibility hash.
        local_geometry: this rank's geometry as ``validate_remote`` sees it.
    """

    def __init__(self, core: Core, plan: RegionPlan, compat_hash: str,
                 local_geometry: Callable[[], EngineGeometry]) -> None:
        self._core = core
        self._plan = plan
        self._hash = compat_hash
        self._local_geometry = local_geometry
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._reports: dict[str, PeerReport] = {}
        self._client: SideChannelClient | None = None

    def open(self) -> None:
        from ..sidechannel import SideChannelClient

        self._client = SideChannelClient()

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def forget_all(self) -> None:
        """Forget every peer without unloading it (NIXL is being released)."""
        with self._core.lock:
            for peer in self._peers.values():
                _forget_transport_series(peer)
            self._peers.clear()
            metrics.PEERS.set(0)

    # -- the assigned set --------------------------------------------------------------------
    def loaded(self) -> dict[str, PeerRef]:
        with self._core.lock:
            return {p.ref.name: p.ref for p in self._peers.values()}

    def reports(self) -> list[PeerReport]:
        with self._core.lock:
            return sorted(self._reports.values(), key=lambda r: r.peer)

    def assign(self, assigned: Iterable[PeerRef | Mapping[str, Any]]) -> list[PeerReport]:
        """See :meth:`AgentService.set_peers`."""
        refs = [a if isinstance(a, PeerRef) else PeerRef.from_status(a) for a in assigned]
        want = {r.key: r for r in refs}
        with self._core.lock:
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
            with self._core.lock:
                self._reports[ref.name] = report
        return self.reports()

    def has_remote(self, engine_id: str) -> bool:
        with self._core.lock:
            return any(k[0] == engine_id for k in self._peers)

    def loaded_since(self, engine_id: str) -> float | None:
        """See :meth:`AgentService.loaded_since`."""
        with self._core.lock:
            return max((p.loaded_at for k, p in self._peers.items() if k[0] == engine_id),
                       default=None)

    def clock_offset(self, engine_id: str) -> ClockOffset | None:
        """See :meth:`AgentService.clock_offset`."""
        with self._core.lock:
            known = [p.clock for k, p in self._peers.items()
                     if k[0] == engine_id and p.clock is not None]
        return min(known, key=lambda c: c.error_s) if known else None

    def epochs_if_stale(self, engine_id: str, expected_epoch: int) -> list[int | None]:
        """The epochs ``engine_id``'s ranks are loaded at, when one is not ``expected_epoch``
        (empty when all match). ``Core.lock`` held."""
        ranks = [p for k, p in self._peers.items() if k[0] == engine_id]
        if any(p.ref.epoch != expected_epoch for p in ranks):
            return sorted({p.ref.epoch for p in ranks})
        return []

    def drop_remote(self, engine_id: str, why: str) -> None:
        with self._core.lock:
            for key in [k for k in self._peers if k[0] == engine_id]:
                self._drop(key, why)

    def send_heartbeat(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """See :meth:`AgentService.send_heartbeat`."""
        from ..nixl import heartbeat_message

        if not request_ids:
            return
        message = heartbeat_message(list(request_ids))
        c = self._core
        with c.lock:
            for key, peer in list(self._peers.items()):
                if key[0] != engine_id or c.agent is None:
                    continue
                try:
                    c.agent.send_notif(peer.agent_name, message)
                except Exception as exc:   # a dead agent: the next request handshakes again
                    log.warning("heartbeat to %s failed: %s", peer.agent_name, exc)
                    self._drop(key, f"heartbeat failed: {exc}")

    def _drop(self, key: tuple[str, int], why: str) -> None:
        c = self._core
        peer = self._peers.pop(key)
        log.info("agent %s: dropping peer %s (%s, NIXL agent %s): %s", c.agent_name,
                 peer.ref.name, peer.ref.engine_id, peer.agent_name, why)
        try:
            if c.mover is not None:
                c.mover.remove_remote(peer.ref.engine_id, peer.ref.tp_rank)
            elif c.agent is not None:
                c.agent.remove_remote(peer.agent_name)
        except Exception as exc:  # the peer may be dead; removal is best effort
            log.warning("removing NIXL remote %s failed: %s", peer.agent_name, exc)
        metrics.PEERS.set(len(self._peers))
        _forget_transport_series(peer)

    # -- one handshake -----------------------------------------------------------------------
    def handshake(self, ref: PeerRef) -> PeerReport:
        """Fetch, validate and load ``ref``; see :meth:`AgentService.handshake`."""
        started = time.perf_counter()
        agent_name = ""
        transport: PeerTransport | None = None
        try:
            meta, clock = self._fetch(ref)
            verdict = self._validate(meta, ref)
            if verdict.ok:
                agent_name, stale, transport = self._load(meta, ref, clock)
                result, message = ((HandshakeOutcome.STALE, stale) if stale
                                   else (HandshakeOutcome.SUCCEEDED, ""))
            else:
                result, message = HandshakeOutcome.INCOMPATIBLE, verdict.summary(limit=5)
        except Exception as exc:
            result, message = _outcome_of(exc)
        report = self._report(ref, result, message, agent_name, time.perf_counter() - started)
        if transport is None or not report.ok:
            return report
        return replace(report, transport=transport.name, transport_detail=transport.detail)

    def _fetch(self, ref: PeerRef) -> tuple[NixlAgentMetadata, ClockOffset]:
        """The peer's metadata from its side channel and its clock against ours (no lock
        held: a slow peer stalls nothing else)."""
        if self._client is None:
            raise self._core.closed()
        s = self._core.settings
        got = self._client.fetch(
            ref.host, ref.port, [(0, ref.tp_rank)], timeout_s=s.handshake_timeout_s,
            local_hash=self._hash, enforce_handshake_compat=s.enforce_hash,
            expected_engine_id=ref.engine_id)
        best = got.best
        return got.metadata(0, ref.tp_rank), ClockOffset(best.clock_offset, best.rtt / 2)

    def _validate(self, meta: NixlAgentMetadata, ref: PeerRef) -> Verdict:
        broken = check_metadata(meta)   # a peer inconsistent with itself, whatever we are
        if not broken.ok:
            return broken
        e = self._core.engine
        remote = EngineGeometry.from_metadata(
            meta, tp_size=ref.tp_size, is_mla=e.is_mla, num_kv_heads=e.num_kv_heads,
            tp_rank=ref.tp_rank, compatibility_hash=self._hash, transfer_mode=e.mode)
        if e.role == DECODE:   # local = D, remote = P (the orientation of validate_remote)
            return validate_remote(self._local_geometry(), remote, mode=e.mode,
                                   expected_engine_id=ref.engine_id,
                                   expected_tp_size=ref.tp_size)
        return validate_remote(replace(remote, engine_id=remote.engine_id),
                               self._local_geometry(), mode=e.mode)

    def _load(self, meta: NixlAgentMetadata, ref: PeerRef, clock: ClockOffset | None = None
              ) -> tuple[str, str, PeerTransport | None]:  # fmt: skip
        """Load the peer into NIXL; returns its agent name, why it is stale when it answered
        with another epoch than assigned (then unloaded again), and the UCX transport that
        reaches it."""
        from ..nixl import RemoteEngine

        c = self._core
        with c.lock:
            if c.agent is None:
                raise AgentClosedError(f"agent {c.agent_name} closed")
            if c.mover is not None:
                agent_name = c.mover.add_remote(RemoteEngine.from_metadata(
                    meta, tp_rank=ref.tp_rank, tp_size=ref.tp_size,
                    local_region_group_ids=self._plan.group_ids,
                    local_mem_type=self._plan.mem_types[0]))
            else:
                if ref.key in self._peers:
                    self._drop(ref.key, "re-handshake")
                agent_name = c.agent.add_remote(bytes(meta.agent_metadata))
            transport = c.agent.transport_of(agent_name)
            if ref.epoch is not None and not agent_name.endswith(f"-e{ref.epoch}"):
                self._unload(ref, agent_name)
                return agent_name, str(StalePeerError(
                    f"side channel {ref.host}:{ref.port} answered with NIXL agent "
                    f"{agent_name!r}, not the assigned epoch {ref.epoch}")), transport
            self._peers[ref.key] = _Peer(ref, agent_name, clock, transport)
            metrics.PEERS.set(len(self._peers))
            if transport is not None:
                metrics.PEER_TRANSPORT.labels(ref.name, transport.name).set(1)
        return agent_name, "", transport

    def _unload(self, ref: PeerRef, agent_name: str) -> None:
        c = self._core
        with contextlib.suppress(Exception):
            if c.mover is not None:
                c.mover.remove_remote(ref.engine_id, ref.tp_rank)
            elif c.agent is not None:
                c.agent.remove_remote(agent_name)

    def _report(self, ref: PeerRef, result: HandshakeOutcome, message: str, agent_name: str,
                elapsed: float) -> PeerReport:
        """Count, log and describe one ended handshake."""
        metrics.HANDSHAKES.labels(result.value).inc()
        metrics.HANDSHAKE_SECONDS.observe(elapsed)
        ok = result is HandshakeOutcome.SUCCEEDED
        (log.info if ok else log.warning)(
            "agent %s: handshake with %s (%s rank %d epoch %s at %s:%d): %s%s",
            self._core.agent_name, ref.name, ref.engine_id, ref.tp_rank, ref.epoch, ref.host,
            ref.port, result, f": {message}" if message else "")
        return PeerReport(ref.name, ref.engine_id, ref.epoch, ok, message, result,
                          utc_timestamp(), agent_name)


def _forget_transport_series(peer: _Peer) -> None:
    """Drop the peer's ``kvbridge_agent_peer_transport`` series (set when it was loaded)."""
    if peer.transport is not None:
        with contextlib.suppress(KeyError):
            metrics.PEER_TRANSPORT.remove(peer.ref.name, peer.transport.name)


def _outcome_of(exc: Exception) -> tuple[HandshakeOutcome, str]:
    """How a handshake that raised ``exc`` ended, and the report's message."""
    from ..nixl import UnsupportedTransferError
    from ..sidechannel import HandshakeTimeoutError, RemoteRejectedError

    if isinstance(exc, HandshakeTimeoutError):
        return HandshakeOutcome.TIMEOUT, str(exc)
    if isinstance(exc, RemoteRejectedError):
        return HandshakeOutcome.REJECTED, str(exc)
    if isinstance(exc, StalePeerError):
        return HandshakeOutcome.STALE, str(exc)
    if isinstance(exc, ProtocolError | UnsupportedTransferError):
        return HandshakeOutcome.INCOMPATIBLE, f"{type(exc).__name__}: {exc}"
    return HandshakeOutcome.ERROR, f"{type(exc).__name__}: {exc}"
