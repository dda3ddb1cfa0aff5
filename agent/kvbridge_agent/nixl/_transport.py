"""Which UCX transport carries the bytes to each peer, read from UCX's own protocol tables.

UCX picks a transport per endpoint configuration (cma within a host, tcp, rc/dc over
InfiniBand, cuda_ipc over NVLink, ...) and falls back silently when the fast one is not
reachable: a pod without a shared PID namespace reads a same-host peer over TCP at a
twentieth of the speed (docs/platform/nixl-on-cpu.md §2.4). Neither NIXL's API nor UCX's environment
says which transport an endpoint got; UCX prints it only in the tables ``UCX_PROTO_INFO=y``
enables, one table per (endpoint configuration, operation), when the configuration is first
used. This module turns those tables into a transport per peer.

Pure parts: :func:`parse_proto_lines` (log lines -> tables) and :class:`TransportBook`
(tables seen while a peer was added -> that peer's transport). I/O: :class:`ProtoInfoLog`,
which asks UCX for the tables in a log file of this process (``UCX_LOG_FILE``; set before the
first agent starts, since UCX reads it once) and passes every other UCX log line on to the
``kvbridge.ucx`` logger, so no warning is lost.

Attribution: an endpoint configuration is printed when its first endpoint is created, which
for NIXL is inside ``add_remote_agent``. A peer whose load printed a remote-memory table uses
that configuration. A peer that printed nothing reuses one seen before; when every known
configuration of that agent names the same transports, that is its transport, otherwise it
is reported ``unknown`` (the candidates are in the detail) rather than guessed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import re
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..rules import UNKNOWN_TRANSPORT as UNKNOWN

__all__ = [
    "UNKNOWN",
    "PeerTransport",
    "ProtoInfoLog",
    "ProtoTable",
    "TransportBook",
    "parse_proto_lines",
]

T = TypeVar("T")

log = logging.getLogger(__name__)
ucx_log = logging.getLogger("kvbridge.ucx")


#: UCX keeps the first 31 characters of a context's name (UCP_ENTITY_NAME_MAX, with its NUL):
#: ``decode-engine-tp0-e1796421496801`` is printed as ``decode-engine-tp0-e179642149680``.
UCX_NAME_MAX = 31
_PREFIX = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s*")
_HEADER = re.compile(r"^\| (?P<agent>\S+) (?P<locality>self|intra-node|inter-node) "
                     r"cfg#(?P<config>\d+)\s*\|$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")
_LEVEL = re.compile(r"\bUCX\s+(?P<level>ERROR|WARN|DIAG|INFO|DEBUG|TRACE\w*)\b")
#: Operations whose lanes carry KV bytes (reads and writes of remote memory).
_RMA = "remote memory"


@dataclass(frozen=True)
class ProtoTable:
    """One printed table: which agent, endpoint configuration and operation, and the
    transport/device lanes named in its rows (``cma/memory``, ``tcp/eth0``, ...)."""

    agent: str
    locality: str
    config: int
    operation: str
    lanes: tuple[str, ...]

    @property
    def moves_kv(self) -> bool:
        return self.operation.startswith(_RMA)


def parse_proto_lines(lines: Iterable[str]) -> tuple[list[ProtoTable], list[str]]:
    """Split UCX log lines into protocol tables and every other line (kept, in order)."""
    tables: list[ProtoTable] = []
    others: list[str] = []
    head: dict[str, str] | None = None
    operation: str | None = None
    lanes: list[str] = []

    def close() -> None:
        if head is not None and operation is not None:
            tables.append(ProtoTable(head["agent"], head["locality"], int(head["config"]),
                                     operation, tuple(dict.fromkeys(lanes))))

    for raw in lines:
        body = _PREFIX.sub("", raw.rstrip("\n"), count=1)
        if not body.startswith(("|", "+")):
            others.append(raw.rstrip("\n"))
            continue
        if body.startswith("+"):
            continue
        match = _HEADER.match(body)
        if match:
            close()
            head, operation, lanes = match.groupdict(), None, []
            continue
        if head is None:
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if operation is None:
            operation = cells[0]
        elif len(cells) >= 3 and cells[0] != "Range":
            lanes.extend(f"{tl}/{dev}" for tl, dev in _LANE.findall(cells[-1]))
    close()
    return tables, others


@dataclass(frozen=True)
class PeerTransport:
    """The transport(s) UCX moves a peer's KV with: ``name`` is the UCX transport names
    joined with ``+`` (``cma``, ``tcp``, ``rc_mlx5``, ``cuda_ipc+rc_mlx5``) or ``unknown``;
    ``detail`` the lanes with their devices, or why it is unknown."""

    name: str
    detail: str
    locality: str = ""

    @property
    def known(self) -> bool:
        return self.name != UNKNOWN


@dataclass
class TransportBook:
    """Endpoint configurations seen per agent, and the transport each peer was given. Pure:
    fed with the tables printed while each peer was added."""

    #: (agent, locality, config) -> lanes of the tables that move KV
    configs: dict[tuple[str, str, int], tuple[str, ...]] = field(default_factory=dict)

    def learn(self, tables: Iterable[ProtoTable]) -> list[tuple[str, str, int]]:
        """Record ``tables``; returns the configurations they named (KV-moving or not)."""
        named: list[tuple[str, str, int]] = []
        for t in tables:
            key = (t.agent, t.locality, t.config)
            if key not in named:
                named.append(key)
            if t.moves_kv:
                known = self.configs.get(key, ())
                self.configs[key] = tuple(dict.fromkeys((*known, *t.lanes)))
        return named

    def transport_for(self, agent: str, printed: Iterable[ProtoTable]) -> PeerTransport:
        """The transport of a peer ``agent`` just loaded, given the tables printed meanwhile."""
        agent = agent[:UCX_NAME_MAX]  # the name as UCX prints it
        named = [k for k in self.learn(printed) if k[0] == agent and k[1] != "self"]
        fresh = [k for k in named if self.configs.get(k)]
        if fresh:
            return _describe([self.configs[k] for k in fresh], fresh[0][1])
        if named:
            return PeerTransport(UNKNOWN, "UCX printed no remote-memory lanes for "
                                 f"configuration {named[0][1]} cfg#{named[0][2]}", named[0][1])
        known = {k: lanes for k, lanes in self.configs.items()
                 if k[0] == agent and k[1] != "self" and lanes}
        if not known:
            return PeerTransport(UNKNOWN, "UCX printed no protocol table for this agent "
                                 "(UCX_PROTO_INFO disabled, or the log is not readable)")
        names = {_names(lanes) for lanes in known.values()}
        if len(names) == 1:
            localities = {k[1] for k in known}
            return _describe(list(known.values()),
                             localities.pop() if len(localities) == 1 else "")
        choices = "; ".join(f"{loc} cfg#{n}: {', '.join(lanes)}"
                            for (_, loc, n), lanes in sorted(known.items()))
        return PeerTransport(UNKNOWN, f"reuses one of several configurations ({choices})")


def _names(lanes: Iterable[str]) -> str:
    return "+".join(sorted({lane.split("/", 1)[0] for lane in lanes}))


def _describe(lane_sets: list[tuple[str, ...]], locality: str) -> PeerTransport:
    lanes = tuple(dict.fromkeys(lane for s in lane_sets for lane in s))
    return PeerTransport(_names(lanes), ", ".join(lanes), locality)


class ProtoInfoLog:
    """This process's UCX log file with protocol tables in it (one per process: UCX reads
    ``UCX_LOG_FILE`` once, when its library initialises).

    :meth:`enable` must run before the first NIXL agent of the process is created; it leaves
    settings the user made alone: ``UCX_PROTO_INFO=n`` turns reporting off, and a
    ``UCX_LOG_FILE`` of the user's is read instead of ours.
    """

    _instance: ProtoInfoLog | None = None
    _lock = threading.Lock()

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.book = TransportBook()
        self._offset = 0
        self._partial = ""
        self._read_lock = threading.Lock()
        self._load_lock = threading.Lock()

    @classmethod
    def enable(cls) -> ProtoInfoLog:
        """The process's log, set up on first call (idempotent)."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(_configure_ucx_env())
            elif cls._instance.path is not None:
                # UCX reads UCX_PROTO_INFO per agent (its log file once per process): keep it
                # on for every agent, whatever the process did to its environment meanwhile.
                os.environ["UCX_PROTO_INFO"] = "y"
            return cls._instance

    def load_peer(self, agent: str, load: Callable[[], T]) -> tuple[T, PeerTransport]:
        """Run ``load`` (agent ``agent`` adding a peer) and tell the peer's transport from
        the tables it printed. Loads are serialised per process, so tables printed by one
        load are never taken for another's."""
        with self._load_lock:
            self.book.learn(self.read_tables())
            result = load()
            return result, self.book.transport_for(agent, self.read_tables())

    def read_tables(self) -> list[ProtoTable]:
        """Tables UCX printed since the last call; other lines go to the ``kvbridge.ucx``
        logger at their UCX level."""
        if self.path is None:
            return []
        with self._read_lock:
            _flush_c_streams()  # UCX writes through stdio: its buffer may hold a table
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    f.seek(self._offset)
                    text = f.read()
                    self._offset = f.tell()
            except OSError:
                return []
            text, self._partial = self._partial + text, ""
            lines = text.split("\n")
            self._partial = lines.pop()  # an unterminated last line waits for the next call
        tables, others = parse_proto_lines(lines)
        for line in others:
            if line.strip():
                ucx_log.log(_level_of(line), "%s", line)
        return tables


def _level_of(line: str) -> int:
    match = _LEVEL.search(line)
    level = match.group("level") if match else "INFO"
    return {"ERROR": logging.ERROR, "WARN": logging.WARNING,
            "DIAG": logging.INFO, "INFO": logging.INFO}.get(level, logging.DEBUG)


def _configure_ucx_env() -> Path | None:
    """Ask UCX for protocol tables in a file of ours; None when the user turned them off or
    UCX was already initialised by someone else in this process."""
    if os.environ.get("UCX_PROTO_INFO", "y").strip().lower() in {"n", "no", "0", "off", "false"}:
        log.info("UCX_PROTO_INFO is off: peers' transports are reported as unknown")
        return None
    os.environ["UCX_PROTO_INFO"] = "y"
    ours = str(Path(tempfile.gettempdir()) / "kvbridge-ucx-%p.log")
    # UCX puts the process id in for %p, so child processes (vLLM's workers) that inherit the
    # setting write files of their own.
    pattern = os.environ.setdefault("UCX_LOG_FILE", ours)
    path = Path(pattern.replace("%p", str(os.getpid())).replace("%h", socket.gethostname()))
    if pattern == ours:
        atexit.register(_remove, path)
        _remove_orphans(Path(ours).parent)
    return path


def _remove_orphans(directory: Path) -> None:
    """Our log files of processes that are gone (killed before their atexit ran)."""
    for old in directory.glob("kvbridge-ucx-*.log"):
        pid = old.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove(old)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _flush_c_streams() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
