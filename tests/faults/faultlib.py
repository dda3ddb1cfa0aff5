"""Helpers for the control-plane fault tests: a TCP proxy that can cut a client off, etcd
compaction through its v3 HTTP gateway, and the statuses the operator should have written.

``expected_statuses`` is the convergence oracle: the operator's pure planner run on what is
stored now (the KVTransfer, its KVEndpoints with their agents' handshake reports, the Nodes).
A converged operator has written exactly that; one that missed an event (a lost watch, a kill
between two writes) has not, and waiting cannot fix it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvbridge_operator import planner, status
from kvbridge_operator.config import ENDPOINTS
from kvbridge_operator.spec import parse_endpoint, parse_transfer

#: The namespace of the fault tests' agents and load, and the agents' pattern seed.
NS, SEED = "faults", 11


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``, for an agent cut off from the apiserver.

    :meth:`cut` drops every connection and refuses new ones (the apiserver unreachable);
    :meth:`stall` keeps connections open but forwards nothing, new ones included (a network
    partition: requests hang until the client's timeout). :meth:`restore` heals both; what a
    stall held back is then delivered, as TCP would after a partition.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self.refused = 0  # connections turned away while cut
        self.held = 0  # connections or chunks held back while stalled
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            socks, self._open = self._open, set()
        for s in socks:
            _close(s)

    def stall(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        with self._lock:
            self._cut = False
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self.cut()
        _close(self._server)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _wait_flowing(self) -> None:
        if not self._flowing.is_set():
            with self._lock:
                self.held += 1
            self._flowing.wait()

    def _serve(self, conn: socket.socket) -> None:
        self._wait_flowing()
        with self._lock:
            cut = self._cut
            if cut:
                self.refused += 1
        if cut or self._closed:
            _close(conn)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _close(conn)
            return
        upstream.settimeout(None)
        with self._lock:
            self._open |= {conn, upstream}
        threading.Thread(target=self._pipe, args=(upstream, conn), daemon=True).start()
        self._pipe(conn, upstream)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._wait_flowing()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._open.discard(s)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@dataclass
class Agents:
    """The module's real agents; ``proxy`` sits between ``d-0`` and the apiserver."""

    cluster: Any
    proxy: TcpProxy
    pods: dict[str, Any] = field(default_factory=dict)

    def start(self, name: str, role: str, engine: str, **kw: Any) -> Any:
        from kvbridge_testkit.sim import SimPod

        p = SimPod(self.cluster, NS, name, role=role, engine_id=engine, seed=SEED, **kw)
        self.pods[name] = p
        p.start()
        return p

    @property
    def decode(self) -> Any:
        return self.pods["d-0"]


# -- etcd ------------------------------------------------------------------------------------
def _etcd(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def etcd_revision(url: str) -> int:
    """etcd's current revision (a range read of one key returns it in the header)."""
    return int(_etcd(url, "/v3/kv/range", {"key": "AA=="})["header"]["revision"])


def compact_etcd(url: str) -> int:
    """Compact etcd's history up to its current revision; returns that revision. Watches
    that resume from an older resourceVersion are then answered 410 Gone."""
    rev = etcd_revision(url)
    _etcd(url, "/v3/kv/compaction", {"revision": str(rev), "physical": True})
    return rev


# -- the convergence oracle ------------------------------------------------------------------
def _without_times(transfer_status: dict[str, Any]) -> dict[str, Any]:
    out = dict(transfer_status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in out.get("conditions") or []
    ]
    return out


def expected_statuses(api: Any, ns: str, transfer: str) -> tuple[dict, dict[str, dict]]:
    """(KVTransfer status, {endpoint: operator-owned status}) the planner derives from what is
    stored now; condition times are left out (they record when, not what)."""
    body = api.transfer(ns, transfer)
    endpoints = [parse_endpoint(e) for e in api.list(ENDPOINTS, ns)]
    nodes = {n.metadata.name: dict(n.metadata.labels or {}) for n in api.core.list_node().items}
    plan = planner.plan(parse_transfer(body), endpoints, nodes)
    generation = int(body["metadata"].get("generation") or 0)
    want = status.transfer_status(plan, body.get("status"), generation=generation, now="")
    by_name = {e.name: e for e in endpoints}
    eps = {v.name: status.endpoint_status(v, by_name[v.name]) for v in plan.endpoints}
    return _without_times(want), eps


def divergence(api: Any, ns: str, transfer: str) -> list[str]:
    """What the stored statuses of ``transfer`` and its endpoints get wrong ([] = converged)."""
    want_transfer, want_eps = expected_statuses(api, ns, transfer)
    got_transfer = _without_times(api.transfer(ns, transfer).get("status") or {})
    problems = []
    if got_transfer != want_transfer:
        keys = sorted(k for k in set(want_transfer) | set(got_transfer)
                      if want_transfer.get(k) != got_transfer.get(k))  # fmt: skip
        problems.append(f"KVTransfer {transfer}: {keys} differ: "
                        f"{ {k: got_transfer.get(k) for k in keys} } != "
                        f"{ {k: want_transfer.get(k) for k in keys} }")  # fmt: skip
    stored = api.endpoints(ns)
    for name, want in want_eps.items():
        got = status.owned_part(stored[name].get("status"))
        if got != want:
            problems.append(f"KVEndpoint {name}: {got} != {want}")
    return problems


def endpoint_census(api: Any, ns: str) -> list[str]:
    """Problems with the set of KVEndpoints: one per (transfer, role, engine, rank), each
    owned by an existing pod; peers name existing endpoints at their current epoch."""
    stored = api.endpoints(ns)
    pods = {p.metadata.uid for p in api.core.list_namespaced_pod(ns).items}
    slots = Counter(
        (e["spec"]["transferName"], e["spec"]["role"], e["spec"]["engineId"], e["spec"]["tpRank"])
        for e in stored.values()
    )
    problems = [f"{n} KVEndpoints for {slot}" for slot, n in slots.items() if n > 1]
    for name, e in stored.items():
        owners = {o["uid"] for o in e["metadata"].get("ownerReferences") or []}
        if not owners & pods:
            problems.append(f"KVEndpoint {name} has no live owning pod")
        for p in (e.get("status") or {}).get("peers") or []:
            peer = stored.get(p["name"])
            if peer is None or peer["spec"]["epoch"] != p["epoch"]:
                problems.append(f"KVEndpoint {name} lists peer {p} that is not stored as such")
    return problems
