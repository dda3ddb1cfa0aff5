"""Prometheus metrics of the agent (own registry, so several agents in one test process and
the operator's metrics never collide). Serve with :func:`serve`.

- ``kvbridge_agent_handshakes_total{result}``: preflight/on-demand handshakes by result
  (``succeeded``, ``incompatible``, ``timeout``, ``rejected``, ``error``, ``stale``);
- ``kvbridge_agent_handshake_seconds``: handshake latency (side channel + validation + add);
- ``kvbridge_agent_transfer_bytes_total`` / ``kvbridge_agent_transfer_descriptors_total``;
- ``kvbridge_agent_transfer_seconds``: request latency, start to every part done (these
  three are counted by :data:`TALLY`, off the engine's step);
- ``kvbridge_agent_transfer_failures_total{cause}``: failures by :class:`FailureCause` value;
- ``kvbridge_agent_late_reads_declined_total``: reads a decode declined because the prefill's
  stated lease deadline had passed, or was within the margin (the request then recomputes
  or fails, by ``kv_load_failure_policy``);
- ``kvbridge_agent_peers``: peers currently loaded (handshake succeeded);
- ``kvbridge_agent_peer_transport{peer,transport}``: 1 per loaded peer, labelled with the UCX
  transport that carries its KV (``cma``, ``tcp``, ``rc_mlx5``, ``cuda_ipc``, ``unknown``;
  :mod:`kvbridge_agent.nixl._transport`); the series goes when the peer is dropped;
- ``kvbridge_agent_info{namespace,transfer,role,engine_id}``: 1 while the agent publishes its
  KVEndpoint (:class:`~kvbridge_agent.kube.EndpointSync`). The other series carry no
  KVTransfer, so the chart's dashboard and alerts join on it by scrape ``instance`` to group
  and filter agents per namespace and KVTransfer (one agent per scraped process).

The labelled counters start with every result and cause at 0, so that failure ratios have a
denominator and dashboards have series before the first failure.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

REGISTRY = CollectorRegistry(auto_describe=True)


class TransferTally:
    """Completed transfers not yet counted in the transfer series.

    Counting one in the Prometheus objects takes three locked updates, paid on the engine's
    step for every request; :meth:`add` is one deque append instead. Registered first in
    :data:`REGISTRY`, the tally folds its backlog into the series whenever the registry is
    collected (a scrape, :func:`value`), so a reader always sees every transfer reported
    before it read. It also folds every :attr:`FOLD_AT` transfers, so an agent that is never
    scraped holds a bounded backlog. ``deque`` append and popleft are atomic: the engine
    thread adds while a scrape thread folds, without a lock.
    """

    FOLD_AT = 1024

    def __init__(self) -> None:
        self._backlog: deque[tuple[int, int, float]] = deque()

    def add(self, nbytes: int, descs: int, seconds: float) -> None:
        backlog = self._backlog
        backlog.append((nbytes, descs, seconds))
        if len(backlog) >= self.FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Move the backlog into TRANSFER_BYTES, TRANSFER_DESCS and TRANSFER_SECONDS."""
        backlog, nbytes, descs = self._backlog, 0, 0
        while backlog:
            try:
                b, d, seconds = backlog.popleft()
            except IndexError:       # another thread folded the last one
                break
            nbytes += b
            descs += d
            TRANSFER_SECONDS.observe(seconds)
        if nbytes:
            TRANSFER_BYTES.inc(nbytes)
        if descs:
            TRANSFER_DESCS.inc(descs)

    def collect(self) -> Iterator[Metric]:
        self.fold()
        return iter(())

    def describe(self) -> Iterator[Metric]:
        return iter(())


TALLY = TransferTally()
REGISTRY.register(TALLY)      # before the series it folds into: collected first

HANDSHAKES = Counter(
    "kvbridge_agent_handshakes", "Handshakes with assigned peers, by result", ["result"],
    registry=REGISTRY)
HANDSHAKE_SECONDS = Histogram(
    "kvbridge_agent_handshake_seconds", "Handshake latency (fetch, validate, add remote)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY)
TRANSFER_BYTES = Counter(
    "kvbridge_agent_transfer_bytes", "Bytes moved by completed transfer requests",
    registry=REGISTRY)
TRANSFER_DESCS = Counter(
    "kvbridge_agent_transfer_descriptors", "Descriptors moved by completed transfer requests",
    registry=REGISTRY)
TRANSFER_SECONDS = Histogram(
    "kvbridge_agent_transfer_seconds", "Transfer request latency (start to all parts done)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
    registry=REGISTRY)
TRANSFER_FAILURES = Counter(
    "kvbridge_agent_transfer_failures", "Failed transfer requests, by cause", ["cause"],
    registry=REGISTRY)
LATE_READS = Counter(
    "kvbridge_agent_late_reads_declined",
    "Reads declined because the prefill's lease deadline had passed or was within the margin",
    registry=REGISTRY)
READS_DECLINED = Counter(
    "kvbridge_agent_reads_declined",
    "Reads a decode declined before starting them, by cause (late_read: the prefill's lease "
    "deadline; model_mismatch: the prefill serves another model)", ["cause"],
    registry=REGISTRY)
PEERS = Gauge("kvbridge_agent_peers", "Peers loaded after a successful handshake",
              registry=REGISTRY)
INFO = Gauge(
    "kvbridge_agent_info", "The KVTransfer, role and engine this agent publishes as (always 1)",
    ["namespace", "transfer", "role", "engine_id"], registry=REGISTRY)
PEER_TRANSPORT = Gauge(
    "kvbridge_agent_peer_transport", "1 per loaded peer, by the UCX transport carrying its KV",
    ["peer", "transport"], registry=REGISTRY)

#: Values of the ``result`` label of HANDSHAKES (service/_agent.py's preflight outcomes).
HANDSHAKE_RESULTS = ("succeeded", "incompatible", "timeout", "rejected", "error", "stale")
#: Values of the ``cause`` label of TRANSFER_FAILURES: every ``nixl.FailureCause`` value and the
#: service's own ``stale_peer`` (tests/unit check that the two lists agree).
FAILURE_CAUSES = ("invalid_request", "unknown_remote", "unsupported", "setup",
                  "remote_disconnect", "timeout", "transfer", "zeroing", "cancelled",
                  "stale_peer")
for _result in HANDSHAKE_RESULTS:
    HANDSHAKES.labels(_result)
for _cause in FAILURE_CAUSES:
    TRANSFER_FAILURES.labels(_cause)


def serve(port: int, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the bound port
    (``port=0`` picks a free one)."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return int(server.server_port)


def value(name: str, **labels: str) -> float:
    """Current value of one sample (tests and the demo); 0.0 when absent."""
    got = REGISTRY.get_sample_value(name, labels or None)
    return float(got or 0.0)


def set_info(namespace: str, transfer: str, role: str, engine_id: str) -> None:
    """Say which KVTransfer this agent serves (see ``kvbridge_agent_info`` above)."""
    INFO.labels(namespace, transfer, role, engine_id).set(1)


def clear_info(namespace: str, transfer: str, role: str, engine_id: str) -> None:
    with contextlib.suppress(KeyError):
        INFO.remove(namespace, transfer, role, engine_id)
