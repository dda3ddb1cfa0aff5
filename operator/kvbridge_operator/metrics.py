"""Prometheus metrics of the operator (served by :func:`serve` on KVBRIDGE_METRICS_PORT).

Labelled counters are created with every label value they can take, so that their series exist
(at 0) from the start: alert ratios and dashboards then have data before the first event.
The chart's dashboard and alerts (charts/kvbridge/dashboards, templates/prometheusrule.yaml)
query these names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from kvbridge_agent.resources import CONDITION_FIELDS, ConditionStatus, ConditionType

from . import config
from .planner import EndpointState, PairState, Plan

RECONCILES = Counter(
    "kvbridge_reconciles_total", "KVTransfer plans computed, by result.", ["result"]
)
RECONCILE_SECONDS = Histogram(
    "kvbridge_reconcile_duration_seconds",
    "Time to plan one KVTransfer and write the changed statuses.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
STATUS_WRITES = Counter(
    "kvbridge_status_writes_total", "Status patches sent, by resource kind.", ["kind"]
)
ENDPOINTS = Gauge(
    "kvbridge_endpoints",
    "KVEndpoints by role and operator state.",
    ["namespace", "transfer", "role", "state"],
)
PAIRS = Gauge("kvbridge_pairs", "Engine pairs by state.", ["namespace", "transfer", "state"])
INCOMPATIBLE_PAIRS = Gauge(
    "kvbridge_incompatible_pairs",
    "Decode/prefill engine pairs that fail a compatibility rule.",
    ["namespace", "transfer"],
)
PAIR_TRANSPORT = Gauge(
    "kvbridge_pair_transport",
    "1 per engine pair and UCX transport its decode ranks report (cma, tcp, rc_mlx5, ...).",
    ["namespace", "transfer", "decode_engine", "prefill_engine", "transport"],
)
TRANSPORT_FALLBACKS = Gauge(
    "kvbridge_transport_fallback_pairs",
    "Verified rank pairs over a transport the KVTransfer's spec.transport.accepted leaves out.",
    ["namespace", "transfer"],
)
REVISION_PAIRS = Gauge(
    "kvbridge_transfer_revision_pairs",
    "Engine pairs per model revision (spec.model.revision, else the fingerprint's first 12 "
    "hex characters, else unknown); a revision with engines and no pair lacks a peer role.",
    ["namespace", "transfer", "revision"],
)
REVISION_ENGINES = Gauge(
    "kvbridge_transfer_revision_engines",
    "Complete engines per model revision and role.",
    ["namespace", "transfer", "revision", "role"],
)
#: revision labels exported per KVTransfer, to drop those of revisions that went away
_revision_series: dict[tuple[str, str], set[str]] = {}
#: PAIR_TRANSPORT label sets exported per KVTransfer, to drop those of pairs that went away.
_pair_transport_series: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
#: The KVTransfer conditions exported by TRANSFER_CONDITION (conditions.py sets these).
CONDITIONS: tuple[str, ...] = tuple(c.value for c in ConditionType)
TRANSFER_CONDITION = Gauge(
    "kvbridge_transfer_condition",
    "KVTransfer status conditions: 1 when the condition's status is True, else 0.",
    ["namespace", "transfer", "condition"],
)
#: Why the admission webhook refused a write: a rule of admission.py (invalid_spec) or a pod
#: writing a KVEndpoint it does not own (pod_identity).
REFUSAL_REASONS = ("invalid_spec", "pod_identity")
ADMISSION_REFUSALS = Counter(
    "kvbridge_admission_refusals",
    "Writes refused by the admission webhook, by resource and reason.",
    ["resource", "reason"],
)
TRACKED = Gauge(
    "kvbridge_tracked_objects",
    "Entries in the operator's own in-memory bookkeeping, by kind; they follow the number of "
    "KVTransfers, KVEndpoints and nodes, not the number of changes.",
    ["kind"],
)
LEADER = Gauge(
    "kvbridge_operator_leader",
    "1 while this operator replica holds the Lease and acts (always 1 with leader election "
    "off), 0 while it stands by (it serves the admission webhook only).",
)
#: How this replica's leadership changed: it acquired the Lease, released it on a clean stop,
#: or lost it (not renewed within the renew deadline; the replica then restarts).
LEADER_CHANGES = ("acquired", "released", "lost")
LEADER_TRANSITIONS = Counter(
    "kvbridge_operator_leader_transitions",
    "Changes of this replica's leadership: acquired, released (clean stop) or lost.",
    ["change"],
)
for _change in LEADER_CHANGES:
    LEADER_TRANSITIONS.labels(_change)
for _result in ("ok", "invalid", "error"):
    RECONCILES.labels(_result)
for _resource in (config.ENDPOINTS, config.TRANSFERS):
    for _reason in REFUSAL_REASONS:
        ADMISSION_REFUSALS.labels(_resource, _reason)


def record(namespace: str, transfer: str, plan: Plan) -> None:
    for role in ("prefill", "decode"):
        for state in EndpointState:
            n = sum(1 for e in plan.endpoints if e.role == role and e.state is state)
            ENDPOINTS.labels(namespace, transfer, role, str(state)).set(n)
    for state in PairState:
        PAIRS.labels(namespace, transfer, str(state)).set(
            sum(1 for p in plan.pairs if p.state is state)
        )
    INCOMPATIBLE_PAIRS.labels(namespace, transfer).set(plan.incompatible_pairs)
    TRANSPORT_FALLBACKS.labels(namespace, transfer).set(len(plan.fallbacks))
    series = {(p.decode_engine, p.prefill_engine, t) for p in plan.pairs for t in p.transports}
    for gone in _pair_transport_series.get((namespace, transfer), set()) - series:
        _remove(PAIR_TRANSPORT, namespace, transfer, *gone)
    for labels in series:
        PAIR_TRANSPORT.labels(namespace, transfer, *labels).set(1)
    _pair_transport_series[(namespace, transfer)] = series
    _record_revisions(namespace, transfer, plan)


def _record_revisions(namespace: str, transfer: str, plan: Plan) -> None:
    """Per-revision gauges; identities sharing a label (a revision over two fingerprints)
    add up, so the series stay one per label."""
    pairs: dict[str, int] = {}
    engines: dict[tuple[str, str], int] = {}
    for r in plan.revisions[:config.MAX_REVISION_SERIES]:
        label = r.identity.label
        pairs[label] = pairs.get(label, 0) + r.pairs
        for role, n in (("prefill", r.prefills), ("decode", r.decodes)):
            engines[(label, role)] = engines.get((label, role), 0) + n
    for gone in _revision_series.get((namespace, transfer), set()) - set(pairs):
        _forget_revision(namespace, transfer, gone)
    for label, n in pairs.items():
        REVISION_PAIRS.labels(namespace, transfer, label).set(n)
    for (label, role), n in engines.items():
        REVISION_ENGINES.labels(namespace, transfer, label, role).set(n)
    _revision_series[(namespace, transfer)] = set(pairs)


def _forget_revision(namespace: str, transfer: str, label: str) -> None:
    _remove(REVISION_PAIRS, namespace, transfer, label)
    for role in ("prefill", "decode"):
        _remove(REVISION_ENGINES, namespace, transfer, label, role)


def record_conditions(namespace: str, transfer: str,
                      conditions: Iterable[Mapping[str, Any]]) -> None:
    """Export the conditions of a KVTransfer status as written (alerts key on Ready/Degraded)."""
    f = CONDITION_FIELDS
    for c in conditions:
        if f.type.get(c) in CONDITIONS:
            TRANSFER_CONDITION.labels(namespace, transfer, f.type.at(c)).set(
                1 if f.status.get(c) == ConditionStatus.TRUE else 0)


def track(sizes: Callable[[], Mapping[str, int]]) -> None:
    """Export every size ``sizes()`` returns as ``kvbridge_tracked_objects{kind}``, read at
    scrape time."""
    for kind in sizes():
        TRACKED.labels(kind).set_function(lambda kind=kind: sizes().get(kind, 0))


def forget(namespace: str, transfer: str) -> None:
    """Drop the series of a deleted KVTransfer."""
    for role in ("prefill", "decode"):
        for state in EndpointState:
            _remove(ENDPOINTS, namespace, transfer, role, str(state))
    for state in PairState:
        _remove(PAIRS, namespace, transfer, str(state))
    _remove(INCOMPATIBLE_PAIRS, namespace, transfer)
    _remove(TRANSPORT_FALLBACKS, namespace, transfer)
    for labels in _pair_transport_series.pop((namespace, transfer), set()):
        _remove(PAIR_TRANSPORT, namespace, transfer, *labels)
    for label in _revision_series.pop((namespace, transfer), set()):
        _forget_revision(namespace, transfer, label)
    for condition in CONDITIONS:
        _remove(TRANSFER_CONDITION, namespace, transfer, condition)


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the metrics HTTP server in a daemon thread (no-op for port 0)."""
    if port:
        start_http_server(port, addr=addr)
