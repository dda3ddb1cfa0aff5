"""Planning step 1: which KVEndpoints can take part, and the engines they form.

Exclusion (terminating, on a node that is not Ready, not selected), staleness (per engine
rank only the highest epoch counts), checks against the KVTransfer itself (mode, TP size,
protocol version, expected geometry) and engine completeness (every TP rank present). Every
endpoint dropped here gets its verdict; what is left are complete engines per role. Pure.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kvbridge_agent import rules
from kvbridge_agent.protocol import EngineGeometry

from .config import DECODE, PREFILL
from .model import EndpointPlan, EndpointState, Problem, endpoint_field
from .revisions import Identity, identity_of
from .spec import Endpoint, Transfer

#: Reason of endpoints excluded because their node is not Ready.
NODE_NOT_READY = "NodeNotReady"


@dataclass(frozen=True)
class Engine:
    """One engine of a role: its endpoints, index = TP rank."""

    role: str
    engine_id: str
    ranks: tuple[Endpoint, ...]

    @property
    def geometry(self) -> tuple[EngineGeometry, ...]:
        return tuple(e.validation_geometry for e in self.ranks)

    @property
    def identity(self) -> Identity:
        return identity_of(self.ranks[0])

    @property
    def key(self) -> tuple[tuple[str, str], tuple[EngineGeometry, ...]]:
        """The engine's class (model identity and geometry): equal keys are checked once."""
        return (self.identity.key, self.geometry)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


class Verdicts:
    """Mutable collector of endpoint verdicts while planning; frozen into the Plan."""

    def __init__(self) -> None:
        self.items: dict[str, EndpointPlan] = {}
        self.problems: list[Problem] = []

    def set(self, e: Endpoint, state: EndpointState, reason: str, message: str) -> None:
        self.items[e.name] = EndpointPlan(e.name, e.role, state, reason, message)

    def incompatible(self, e: Endpoint, rule: str, field: str, message: str) -> None:
        self.set(e, EndpointState.INCOMPATIBLE, str(EndpointState.INCOMPATIBLE),
                 f"{field}: {message}")
        self.problems.append(Problem(e.name, e.role, rule, field, message))


def eligible_engines(
    transfer: Transfer, eps: list[Endpoint], v: Verdicts, lost_nodes: frozenset[str] = frozenset()
) -> dict[str, dict[str, Engine]]:
    """Complete engines per role; a verdict in ``v`` for every endpoint dropped."""
    current = _drop_stale(_exclude(transfer, eps, v, lost_nodes), v)
    checked = [e for e in current if not _topology_check(transfer, e, v)]
    return _engines(transfer, checked, current, v)


def _exclude(transfer: Transfer, eps: list[Endpoint], v: Verdicts,
             lost_nodes: frozenset[str]) -> list[Endpoint]:  # fmt: skip
    live = []
    for e in eps:
        selector = transfer.role(e.role).selector
        if e.deleting:
            v.set(e, EndpointState.EXCLUDED, "Terminating", "the endpoint is being deleted")
        elif e.node_name and e.node_name in lost_nodes:
            v.set(e, EndpointState.EXCLUDED, NODE_NOT_READY,
                  f"node {e.node_name} is not Ready (its kubelet stopped reporting, or reports "
                  "it unhealthy): no peers until it is Ready again")  # fmt: skip
        elif selector is not None and not selector.matches(e.label_map):
            v.set(
                e,
                EndpointState.EXCLUDED,
                "NotSelected",
                f"metadata.labels do not match spec.{e.role}.selector of KVTransfer "
                f"{transfer.name}",
            )
        else:
            live.append(e)
    return live


def _drop_stale(eps: list[Endpoint], v: Verdicts) -> list[Endpoint]:
    slots: dict[tuple[str, str, int], list[Endpoint]] = defaultdict(list)
    for e in eps:
        slots[(e.role, e.engine_id, e.tp_rank)].append(e)
    current = []
    for (_, engine, rank), group in sorted(slots.items()):
        group.sort(key=lambda e: (e.epoch, e.name))
        winner = group[-1]
        current.append(winner)
        for e in group[:-1]:
            why = "a newer epoch" if e.epoch < winner.epoch else "the same epoch (duplicate)"
            v.set(
                e,
                EndpointState.STALE,
                "SupersededEpoch" if e.epoch < winner.epoch else "DuplicateRank",
                f"engine {engine} rank {rank} is also published by KVEndpoint {winner.name} "
                f"with {why} (spec.epoch {e.epoch} vs {winner.epoch})",
            )
    return sorted(current, key=lambda e: e.name)


def _topology_check(transfer: Transfer, e: Endpoint, v: Verdicts) -> bool:
    """Endpoint against the KVTransfer spec (and the rule table's rules on the endpoint alone,
    for objects that slipped past admission); records and returns True on a problem."""
    role = transfer.role(e.role)
    checks: list[tuple[str, str, Any, Any, str] | rules.Finding | None] = [
        (
            "protocol_version",
            "spec.protocolVersion",
            transfer.protocol_version,
            e.protocol_version,
            "KVTransfer spec.protocolVersion",
        ),
        rules.protocol_version(e.protocol_version, name=endpoint_field),
        ("transfer_mode", "spec.mode", transfer.mode, e.mode, "KVTransfer spec.mode"),
        (
            "tp_size",
            "spec.tpSize",
            role.tp_size,
            e.tp_size,
            f"KVTransfer spec.{e.role}.tensorParallelSize",
        ),
        rules.tp_rank(e.tp_rank, e.tp_size, name=endpoint_field),
    ]
    exp = role.expected
    if exp is not None:
        g = e.geometry
        for key, path, value in (
            ("block_size", "blockSize", g.block_size),
            ("kv_cache_layout", "kvCacheLayout", g.kv_cache_layout),
            ("attention_backend", "attentionBackend", g.attention_backend),
            ("num_regions", "regions", len(g.regions)),
        ):
            want = getattr(exp, key)
            if want is not None:
                checks.append(
                    (
                        "expected_geometry",
                        f"spec.geometry.{path}",
                        want,
                        value,
                        f"KVTransfer spec.{e.role}.expectedGeometry.{path}",
                    )
                )
    for check in checks:
        if isinstance(check, rules.Finding):
            v.incompatible(e, check.rule.reports, check.field, check.text)
            return True
        if check is not None:
            rule, field, want, got, source = check
            if got != want:
                v.incompatible(e, rule, field, f"expected {want!r} ({source}), got {got!r}")
                return True
    return False


def _engines(
    transfer: Transfer, checked: list[Endpoint], current: list[Endpoint], v: Verdicts
) -> dict[str, dict[str, Engine]]:
    """Complete, topology-clean engines per role; the rest of their ranks get a verdict."""
    failed = {(e.role, e.engine_id) for e in current if e.name in v.items}
    ranks: dict[tuple[str, str], dict[int, Endpoint]] = defaultdict(dict)
    for e in checked:
        ranks[(e.role, e.engine_id)][e.tp_rank] = e
    engines: dict[str, dict[str, Engine]] = {PREFILL: {}, DECODE: {}}
    for (role, engine_id), by_rank in sorted(ranks.items()):
        tp = transfer.role(role).tp_size
        if (role, engine_id) in failed:
            for e in by_rank.values():
                v.set(
                    e,
                    EndpointState.UNPAIRED,
                    "EngineIncompatible",
                    f"another rank of engine {engine_id} is incompatible; see its KVEndpoint",
                )
            continue
        missing = sorted(set(range(tp)) - set(by_rank))
        if missing:
            for e in by_rank.values():
                v.set(
                    e,
                    EndpointState.UNPAIRED,
                    "EngineIncomplete",
                    f"engine {engine_id} has TP ranks {sorted(by_rank)} of "
                    f"tensorParallelSize {tp}; waiting for ranks {missing}",
                )
            continue
        engines[role][engine_id] = Engine(role, engine_id, tuple(by_rank[r] for r in range(tp)))
    return engines
