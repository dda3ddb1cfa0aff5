"""A thin, typed wrapper over one NIXL agent: memory, descriptor lists, peers, transfers.

Ownership: a :class:`NixlAgent` owns its NIXL agent, every registration and every prepared
descriptor list made through it; :meth:`NixlAgent.close` (or leaving the ``with`` block)
releases them in reverse order of acquisition. Transfer handles belong to whoever created
them (the engines), which must release them; :meth:`close` releases leftovers last-chance.

Threads: NIXL runs one progress thread per agent. The stock Python wrapper hard-codes its
delay to 0, which busy-spins a full core even when idle (docs/platform/nixl-on-cpu.md §0, §1.3); we
patch the delay to ``AgentConfig.progress_delay_us`` (100 µs by default) while constructing.
NIXL is not assumed thread-safe: call one agent from one thread at a time.

Errors: every NIXL exception is re-raised as :class:`~._errors.NixlCallError` (``raise from``)
carrying a :class:`~.errors.FailureCause`; transfer states are the :class:`XferState` enum.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import (
    CallDetail,
    DataPlaneError,
    FailureCause,
    NixlCallError,
    call_error,
    nixl_call,
)
from ._loader import NixlModule, load_nixl
from ._memtypes import PRODUCTION_MEM_TYPES, MemTypeMap
from ._transport import PeerTransport, ProtoInfoLog

__all__ = ["LOCAL_AGENT", "AgentConfig", "DList", "NixlAgent", "XferHandle", "XferState"]

log = logging.getLogger(__name__)

#: Agent name NIXL uses for preparing local (initiator-side) descriptor lists.
LOCAL_AGENT = "NIXL_INIT_AGENT"

_construct_lock = threading.Lock()


class XferState(enum.Enum):
    DONE = "done"
    IN_PROGRESS = "in_progress"


@dataclass(frozen=True)
class AgentConfig:
    """How to build the NIXL agent.

    Attributes:
        progress_delay_us: sleep of the progress thread between polls (0 = busy spin).
        backends: NIXL backends to instantiate.
        num_threads: UCX worker threads (0 = NIXL default).
        capture_telemetry: enable per-transfer telemetry.
        mem_types: logical kind -> NIXL memory type map (production vs CPU tests).
    """

    progress_delay_us: int = 100
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    capture_telemetry: bool = False
    mem_types: MemTypeMap = PRODUCTION_MEM_TYPES

    def __post_init__(self) -> None:
        if self.progress_delay_us < 0:
            raise ValueError(
                f"AgentConfig.progress_delay_us: expected >= 0, got {self.progress_delay_us}"
            )


@dataclass(eq=False)
class DList:
    """A prepared descriptor list of one memory kind, local or against one remote agent.

    ``table`` is the (N, 3) uint64 (addr, len, dev) array it was prepared from (kept for
    coalescing and range checks); ``peer`` is ``LOCAL_AGENT`` for local lists.
    """

    peer: str
    kind: str
    table: np.ndarray
    handle: Any = field(repr=False)
    released: bool = False

    @property
    def size(self) -> int:
        return int(self.table.shape[0])


@dataclass(eq=False, slots=True)
class XferHandle:
    """One NIXL transfer request (a prepared READ/WRITE), plus what it moves."""

    handle: Any = field(repr=False)
    label: str
    peer: str
    num_descs: int
    nbytes: int
    released: bool = False


_I32 = np.dtype(np.int32)
_STATES = {"DONE": XferState.DONE, "PROC": XferState.IN_PROGRESS}


def _index_array(ids: np.ndarray) -> np.ndarray:
    """``ids`` as NIXL takes them: a contiguous int32 array passes as is (NIXL's own index
    type, no conversion); anything else goes as int64 and NIXL converts it, never
    narrowed here, where an id past int32 would silently wrap."""
    if type(ids) is np.ndarray and ids.dtype is _I32 and ids.flags.c_contiguous:
        return ids
    return np.ascontiguousarray(ids, dtype=np.int64)


def _bad_state(status: str, what: str, x: XferHandle) -> XferState:
    raise NixlCallError(f"{what}({x.label}): NIXL reported state {status!r}",
                        FailureCause.TRANSFER)


class NixlAgent:
    """One NIXL agent with registered memory, prepared lists and known peers.

    Args:
        name: agent name; must be unique among the agents a peer talks to.
        config: see :class:`AgentConfig`.
        nixl: a loaded NIXL build (default: :func:`load_nixl`).

    Raises:
        NixlUnavailableError: no NIXL build is installed.
        NixlCallError: the agent or a backend could not be created.
    """

    def __init__(
        self, name: str, config: AgentConfig | None = None, *, nixl: NixlModule | None = None
    ) -> None:
        self.name = name
        self.config = config or AgentConfig()
        self._proto = ProtoInfoLog.enable()  # before UCX first initialises in this process
        self._transports: dict[str, PeerTransport] = {}
        self._nixl = nixl or load_nixl()
        self._registrations: list[tuple[str, Any]] = []
        self._dlists: list[DList] = []
        self._remotes: set[str] = set()
        self._xfers: list[XferHandle] = []
        self._closed = False
        api, bindings = self._nixl.api, self._nixl.bindings
        conf = api.nixl_agent_config(
            backends=list(self.config.backends),
            num_threads=self.config.num_threads,
            capture_telemetry=self.config.capture_telemetry,
        )
        delay = int(self.config.progress_delay_us)
        with _construct_lock, nixl_call(f"create NIXL agent {name!r}", FailureCause.SETUP):
            original = bindings.nixlAgent

            def _agent_with_delay(agent_name: str, agent_config: Any) -> Any:
                agent_config.pthrDelay = delay
                return original(agent_name, agent_config)

            bindings.nixlAgent = _agent_with_delay
            try:
                self._agent = api.nixl_agent(name, conf)
            finally:
                bindings.nixlAgent = original

    # -- context management -------------------------------------------------------------
    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NixlAgent({self.name!r}, closed={self._closed})"

    @property
    def mem_types(self) -> MemTypeMap:
        return self.config.mem_types

    @property
    def nixl_package(self) -> str:
        return self._nixl.package

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError(f"NIXL agent {self.name!r} is closed")

    # -- memory ---------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata blob (what a peer passes to :meth:`add_remote`)."""
        self._check_open()
        with nixl_call("get_agent_metadata", FailureCause.SETUP):
            return bytes(self._agent.get_agent_metadata())

    def register_ranges(self, kind: str, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Register ``(start, length, device_id)`` ranges of one logical kind in one call."""
        self._check_open()
        nixl_type = self.mem_types.nixl_type(kind)
        rows = [
            (int(start), int(length), self.mem_types.device_id(kind, dev), "")
            for start, length, dev in ranges
        ]
        if not rows:
            return
        with nixl_call(f"register_memory({len(rows)} {kind} ranges as {nixl_type})",
                        FailureCause.SETUP):
            reg = self._agent.register_memory(rows, nixl_type)
        self._registrations.append((kind, reg))

    def register_plan(self, plan: Any) -> None:
        """Register every registration range of a geometry ``RegionPlan``, one call per kind
        (DRAM before VRAM, spec §2.5); DRAM on device 0, VRAM on the range's device."""
        kinds = sorted({r.mem_type for r in plan.registrations})
        for kind in kinds:
            self.register_ranges(
                kind, ((r.start, r.length, r.device_id) for r in plan.registrations_for(kind))
            )

    # -- descriptor lists -----------------------------------------------------------------
    def _prep(self, peer: str, table: np.ndarray, kind: str) -> DList:
        self._check_open()
        table = np.ascontiguousarray(table, dtype=np.uint64).reshape(-1, 3)
        nixl_type = self.mem_types.nixl_type(kind)
        if table.shape[0] and nixl_type == "DRAM":
            table = table.copy()
            table[:, 2] = 0
        with nixl_call(f"prep_xfer_dlist({peer}, {table.shape[0]} {kind} descs)",
                        FailureCause.SETUP):
            handle = self._agent.prep_xfer_dlist(peer, table, nixl_type)
        dl = DList(peer=peer, kind=kind, table=table, handle=handle)
        self._dlists.append(dl)
        return dl

    def prep_local(self, table: np.ndarray, kind: str) -> DList:
        """Prepare a local (N, 3) (addr, len, dev) table of one kind, once."""
        return self._prep(LOCAL_AGENT, table, kind)

    def prep_remote(self, peer: str, table: np.ndarray, kind: str) -> DList:
        """Prepare a remote table against ``peer`` (which must have been added)."""
        if peer not in self._remotes:
            raise NixlCallError(
                f"prep_xfer_dlist: remote agent {peer!r} was not added", FailureCause.SETUP
            )
        return self._prep(peer, table, kind)

    def release_dlist(self, dl: DList) -> None:
        """Release a prepared list (idempotent)."""
        if dl.released:
            return
        dl.released = True
        with contextlib.suppress(ValueError):
            self._dlists.remove(dl)
        with nixl_call("release_dlist_handle", FailureCause.TRANSFER):
            dl.handle.release()

    # -- peers ----------------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name.

        A peer that restarted under the same name must be removed first (NIXL refuses with
        ``nixlNotAllowedError``); callers use :meth:`remove_remote` before re-adding.
        """
        self._check_open()
        with nixl_call("add_remote_agent", FailureCause.SETUP):
            name, transport = self._proto.load_peer(
                self.name, lambda: self._agent.add_remote_agent(bytes(metadata)))
        peer = name.decode() if isinstance(name, bytes | bytearray) else str(name)
        self._remotes.add(peer)
        self._transports[peer] = transport
        log.info("NIXL agent %s reaches %s over %s (%s)", self.name, peer, transport.name,
                 transport.detail)
        return peer

    def transport_of(self, peer: str) -> PeerTransport | None:
        """The UCX transport that carries transfers to a loaded ``peer`` (see
        :mod:`._transport`); None for a peer not loaded."""
        return self._transports.get(peer)

    def remove_remote(self, peer: str) -> None:
        """Forget a peer: release its prepared lists first, then remove it (idempotent)."""
        for dl in [d for d in self._dlists if d.peer == peer]:
            try:
                self.release_dlist(dl)
            except NixlCallError as exc:
                log.warning("releasing a prepared list of removed peer %s failed: %s", peer, exc)
        self._transports.pop(peer, None)
        if peer in self._remotes:
            self._remotes.discard(peer)
            with nixl_call(f"remove_remote_agent({peer})", FailureCause.SETUP):
                self._agent.remove_remote_agent(peer)

    def has_remote(self, peer: str) -> bool:
        return peer in self._remotes

    # -- transfers ------------------------------------------------------------------------
    def make_prepped(
        self,
        op: str,
        local: DList,
        local_ids: np.ndarray,
        remote: DList,
        remote_ids: np.ndarray,
        *,
        notif: bytes = b"",
        label: str = "",
        nbytes: int | None = None,
    ) -> XferHandle:
        """Create a transfer from two prepared lists and positional index arrays
        (``nbytes``: what they move, when the caller knows it; else summed here)."""
        self._check_open()
        lid = _index_array(local_ids)
        rid = _index_array(remote_ids)
        if nbytes is None:
            in_range = lid.size and int(lid.min()) >= 0 and int(lid.max()) < local.size
            nbytes = int(local.table[lid, 1].sum()) if in_range else 0
        try:
            h = self._agent.make_prepped_xfer(op, local.handle, lid, remote.handle, rid, notif)
        except Exception as exc:
            raise call_error(exc, "make_prepped_xfer", FailureCause.SETUP,
                              CallDetail(op, label, lid.size)) from exc
        x = XferHandle(h, label or op, remote.peer, int(lid.size), nbytes)
        self._xfers.append(x)
        return x

    def make_direct(
        self,
        op: str,
        local_rows: np.ndarray,
        remote_rows: np.ndarray,
        kinds: tuple[str, str],
        peer: str,
        *,
        notif: bytes = b"",
        label: str = "",
    ) -> XferHandle:
        """Create a one-shot transfer from explicit (N, 3) rows (used for coalesced runs)."""
        self._check_open()
        api_agent = self._agent
        ltype = self.mem_types.nixl_type(kinds[0])
        rtype = self.mem_types.nixl_type(kinds[1])
        with nixl_call(f"initialize_xfer({op} {label}, {len(local_rows)} descs)",
                        FailureCause.SETUP):
            ld = api_agent.get_xfer_descs(np.ascontiguousarray(local_rows, np.uint64), ltype)
            rd = api_agent.get_xfer_descs(np.ascontiguousarray(remote_rows, np.uint64), rtype)
            h = api_agent.initialize_xfer(op, ld, rd, peer, notif)
        x = XferHandle(h, label or op, peer, len(local_rows), int(np.sum(local_rows[:, 1])))
        self._xfers.append(x)
        return x

    def post(self, x: XferHandle, notif: bytes = b"") -> XferState:
        """Post a transfer. With CMA on one host the copy happens inside this call."""
        try:
            status = self._agent.transfer(x.handle, notif) if notif else self._agent.transfer(
                x.handle)
        except Exception as exc:
            raise call_error(exc, "transfer", FailureCause.TRANSFER, x.label) from exc
        return _STATES.get(status) or _bad_state(status, "transfer", x)

    def state(self, x: XferHandle) -> XferState:
        """Poll a posted transfer. Raises NixlCallError on failure (never returns 'ERR')."""
        try:
            status = self._agent.check_xfer_state(x.handle)
        except Exception as exc:
            raise call_error(exc, "check_xfer_state", FailureCause.TRANSFER, x.label) from exc
        return _STATES.get(status) or _bad_state(status, "check_xfer_state", x)

    def release(self, x: XferHandle) -> None:
        """Release a transfer (cancels it if in flight). Idempotent; raises if NIXL refuses,
        in which case the handle stays owned and must be kept (its DMA may still run)."""
        if x.released:
            return
        try:
            x.handle.release()
        except Exception as exc:
            raise call_error(exc, "release", FailureCause.TRANSFER, x.label) from exc
        x.released = True
        xfers = self._xfers
        if xfers and xfers[-1] is x:      # the usual case: the newest transfer ends first
            xfers.pop()
        elif x in xfers:
            xfers.remove(x)

    def telemetry(self, x: XferHandle) -> Any:
        with nixl_call("get_xfer_telemetry", FailureCause.TRANSFER):
            return self._agent.get_xfer_telemetry(x.handle)

    # -- notifications --------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        with nixl_call("send_notif", FailureCause.TRANSFER, peer):
            self._agent.send_notif(peer, message)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Drain new notifications: ``{peer_name: [message, ...]}``."""
        self._check_open()
        with nixl_call("get_new_notifs", FailureCause.TRANSFER):
            raw = self._agent.get_new_notifs()
        return {str(k): [bytes(m) for m in v] for k, v in raw.items()}

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Release transfers, lists, peers and registrations, in that order (idempotent)."""
        if self._closed:
            return
        for x in list(self._xfers):
            try:
                self.release(x)
            except NixlCallError as exc:
                log.warning("agent %s: leaked transfer %s on close: %s", self.name, x.label, exc)
        for dl in list(reversed(self._dlists)):
            try:
                self.release_dlist(dl)
            except NixlCallError as exc:
                log.warning("agent %s: releasing a list on close failed: %s", self.name, exc)
        for peer in sorted(self._remotes):
            try:
                self.remove_remote(peer)
            except NixlCallError as exc:
                log.warning("agent %s: removing %s on close failed: %s", self.name, peer, exc)
        for kind, reg in reversed(self._registrations):
            try:
                with nixl_call("deregister_memory", FailureCause.SETUP):
                    self._agent.deregister_memory(reg)
            except NixlCallError as exc:
                log.warning("agent %s: deregistering %s failed: %s", self.name, kind, exc)
        self._registrations.clear()
        self._closed = True
        self._agent = None
