"""The planner: one KVTransfer and its KVEndpoints in, pairing and verdicts out.

Pure and deterministic: no kopf, no Kubernetes client, no clock. The same input (including
the peers the operator assigned last time, read back from the endpoints' status) gives the
same :class:`Plan`, with stable ordering, so a restarted operator reproduces it exactly.

Steps, in order:

1. exclusion: terminating endpoints and endpoints the role selector does not match;
2. staleness: per (role, engine, TP rank) only the highest epoch counts;
3. topology checks against the KVTransfer (mode, TP size, protocol version, expected geometry);
4. engines: an engine is usable when all its TP ranks are present and pass step 3;
5. compatibility: every decode rank against the prefill ranks it handshakes with (spec §1.9
   rank mapping) through the agent's own :func:`kvbridge_agent.protocol.validate_remote`,
   memoised on geometry classes so thousands of identical engines cost one check;
6. pairing: each decode engine gets ``prefillPerDecode`` compatible prefill engines, keeping
   previous assignments while balanced, otherwise least-loaded (same topology first for the
   TopologyAware policy), ties broken by engine id;
7. peers, handshake verification (agent-reported results at the peer's current epoch),
   counts and the desired conditions.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.geometry import GeometryError, handshake_target_ranks
from kvbridge_agent.protocol import (
    NIXL_CONNECTOR_VERSION,
    EngineGeometry,
    ValidationOptions,
    validate_remote,
)

from .conditions import desired_conditions
from .config import DECODE, PREFILL
from .model import (  # re-exported: the planner's public output types
    DesiredCondition,
    EndpointPlan,
    EndpointState,
    Pair,
    PairState,
    Peer,
    Plan,
    Problem,
    RoleCounts,
    endpoint_field,
)

__all__ = [
    "DesiredCondition",
    "EndpointPlan",
    "EndpointState",
    "Pair",
    "PairState",
    "Peer",
    "Plan",
    "Problem",
    "RoleCounts",
    "endpoint_field",
    "plan",
]
from .spec import Endpoint, Handshake, Transfer

# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Engine:
    role: str
    engine_id: str
    ranks: tuple[Endpoint, ...]  # index = TP rank

    @property
    def key(self) -> tuple[EngineGeometry, ...]:
        return tuple(e.validation_geometry for e in self.ranks)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


class _Verdicts:
    """Mutable collector used while planning; frozen into :class:`Plan` at the end."""

    def __init__(self) -> None:
        self.items: dict[str, EndpointPlan] = {}
        self.problems: list[Problem] = []

    def set(self, e: Endpoint, state: EndpointState, reason: str, message: str) -> None:
        self.items[e.name] = EndpointPlan(e.name, e.role, state, reason, message)

    def incompatible(self, e: Endpoint, rule: str, field: str, message: str) -> None:
        self.set(e, EndpointState.INCOMPATIBLE, "Incompatible", f"{field}: {message}")
        self.problems.append(Problem(e.name, e.role, rule, field, message))


def plan(
    transfer: Transfer,
    endpoints: Iterable[Endpoint],
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> Plan:
    """Plan one KVTransfer; see the module docstring. Pure."""
    v = _Verdicts()
    eps = sorted((e for e in endpoints if e.transfer == transfer.name), key=lambda e: e.name)
    live = _exclude(transfer, eps, v)
    current = _drop_stale(live, v)
    checked = [e for e in current if not _topology_check(transfer, e, v)]
    engines = _engines(transfer, checked, current, v)
    compat = _Compatibility(transfer)
    usable_d, usable_p, incompatible_pairs = _classify(engines, compat, v)
    assignment = _pair(transfer, usable_d, usable_p, node_labels or {})
    pairs = _peers_and_handshakes(usable_d, usable_p, assignment, v, push=transfer.mode == "push")
    return _finish(transfer, eps, v, engines, pairs, incompatible_pairs)


def _exclude(transfer: Transfer, eps: list[Endpoint], v: _Verdicts) -> list[Endpoint]:
    live = []
    for e in eps:
        selector = transfer.role(e.role).selector
        if e.deleting:
            v.set(e, EndpointState.EXCLUDED, "Terminating", "the endpoint is being deleted")
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


def _drop_stale(eps: list[Endpoint], v: _Verdicts) -> list[Endpoint]:
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


def _topology_check(transfer: Transfer, e: Endpoint, v: _Verdicts) -> bool:
    """Endpoint against the KVTransfer spec; records and returns True on a problem."""
    role = transfer.role(e.role)
    checks: list[tuple[str, str, Any, Any, str]] = [
        (
            "protocol_version",
            "spec.protocolVersion",
            transfer.protocol_version,
            e.protocol_version,
            "KVTransfer spec.protocolVersion",
        ),
        (
            "protocol_version",
            "spec.protocolVersion",
            NIXL_CONNECTOR_VERSION,
            e.protocol_version,
            "the NIXL connector version kvbridge speaks",
        ),
        ("transfer_mode", "spec.mode", transfer.mode, e.mode, "KVTransfer spec.mode"),
        (
            "tp_size",
            "spec.tpSize",
            role.tp_size,
            e.tp_size,
            f"KVTransfer spec.{e.role}.tensorParallelSize",
        ),
        ("tp_rank", "spec.tpRank", f"< {e.tp_size}", e.tp_rank, "spec.tpSize"),
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
    for rule, field, want, got, source in checks:
        bad = not got < e.tp_size if rule == "tp_rank" else got != want
        if bad:
            v.incompatible(e, rule, field, f"expected {want!r} ({source}), got {got!r}")
            return True
    return False


def _engines(
    transfer: Transfer, checked: list[Endpoint], current: list[Endpoint], v: _Verdicts
) -> dict[str, dict[str, _Engine]]:
    """Complete, topology-clean engines per role; the rest of their ranks get a verdict."""
    failed = {(e.role, e.engine_id) for e in current if e.name in v.items}
    ranks: dict[tuple[str, str], dict[int, Endpoint]] = defaultdict(dict)
    for e in checked:
        ranks[(e.role, e.engine_id)][e.tp_rank] = e
    engines: dict[str, dict[str, _Engine]] = {PREFILL: {}, DECODE: {}}
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
        engines[role][engine_id] = _Engine(role, engine_id, tuple(by_rank[r] for r in range(tp)))
    return engines


@dataclass(frozen=True)
class _Candidates:
    """The compatible prefill engines of one decode geometry class (shared by its engines)."""

    index: int
    ids: list[str]
    members: frozenset[str]


class _Compatibility:
    """Decode-engine class vs prefill-engine class verdicts, memoised per rank geometry."""

    def __init__(self, transfer: Transfer) -> None:
        self.mode = transfer.mode
        self.p_tp = transfer.prefill.tp_size
        self.options = ValidationOptions(enforce_handshake_compat=transfer.enforce_hash)
        self._ranks: dict[tuple[EngineGeometry, EngineGeometry], Any] = {}
        self._engines: dict[tuple[Any, Any], tuple[int, int, Any] | None] = {}

    def check(self, d: _Engine, p: _Engine) -> tuple[int, int, Any] | None:
        """None when compatible, else (decode rank, prefill rank, first Incompatibility)."""
        key = (d.key, p.key)
        if key not in self._engines:
            self._engines[key] = self._check(d, p)
        return self._engines[key]

    def _check(self, d: _Engine, p: _Engine) -> tuple[int, int, Any] | None:
        for r, dg in enumerate(d.key):
            try:
                targets = handshake_target_ranks(r, d.tp_size, p.tp_size)
            except GeometryError as exc:
                return (r, 0, exc)
            for t in targets:
                pair = (dg, p.key[t])
                if pair not in self._ranks:
                    self._ranks[pair] = validate_remote(
                        dg,
                        p.key[t],
                        mode=self.mode,
                        expected_tp_size=self.p_tp,
                        options=self.options,
                    )
                verdict = self._ranks[pair]
                if not verdict.ok:
                    return (r, t, verdict.problems[0])
        return None


def _classify(
    engines: dict[str, dict[str, _Engine]], compat: _Compatibility, v: _Verdicts
) -> tuple[dict[str, tuple[_Engine, _Candidates]], dict[str, _Engine], int]:
    """Compatible prefill engines per decode engine; marks engines compatible with none."""
    d_classes: dict[Any, list[_Engine]] = defaultdict(list)
    p_classes: dict[Any, list[_Engine]] = defaultdict(list)
    for d in engines[DECODE].values():
        d_classes[d.key].append(d)
    for p in engines[PREFILL].values():
        p_classes[p.key].append(p)
    ok_for_d: dict[Any, list[Any]] = defaultdict(list)
    used_p: set[Any] = set()
    incompatible_pairs = 0
    first_fail: dict[Any, tuple[_Engine, tuple[int, int, Any]]] = {}
    p_first_fail: dict[Any, tuple[_Engine, tuple[int, int, Any]]] = {}
    for dk, ds in d_classes.items():
        for pk, ps in sorted(p_classes.items(), key=lambda kv: kv[1][0].engine_id):
            fail = compat.check(ds[0], ps[0])
            if fail is None:
                ok_for_d[dk].append(pk)
                used_p.add(pk)
            else:
                incompatible_pairs += len(ds) * len(ps)
                first_fail.setdefault(dk, (ps[0], fail))
                p_first_fail.setdefault(pk, (ds[0], fail))
    usable_d: dict[str, tuple[_Engine, _Candidates]] = {}
    for index, (dk, ds) in enumerate(d_classes.items()):
        if ok_for_d.get(dk):
            ids = sorted(p.engine_id for pk in ok_for_d[dk] for p in p_classes[pk])
            group = _Candidates(index, ids, frozenset(ids))
            for d in ds:
                usable_d[d.engine_id] = (d, group)
        elif dk in first_fail:
            p, fail = first_fail[dk]
            for d in ds:
                _engine_incompatible(v, d, p, fail, len(engines[PREFILL]))
    if not p_classes:
        for d in engines[DECODE].values():
            for e in d.ranks:
                v.set(
                    e,
                    EndpointState.UNPAIRED,
                    "NoPrefillEngines",
                    "no complete, compatible prefill engine is available yet",
                )
    usable_p = {}
    for pk, ps in p_classes.items():
        if pk in used_p or not d_classes:
            usable_p.update({p.engine_id: p for p in ps})
        elif usable_d:  # other prefill engines serve the decodes: this one is the odd one
            d, fail = p_first_fail[pk]
            for p in ps:
                _engine_incompatible(v, p, d, fail, len(engines[DECODE]), decode_side=d)
        else:  # nothing pairs at all; the decode endpoints carry the reason
            for p in ps:
                for e in p.ranks:
                    v.set(
                        e,
                        EndpointState.UNPAIRED,
                        "NoCompatibleDecode",
                        "no decode engine is compatible with this prefill engine; see the "
                        "decode KVEndpoints' status for the rule",
                    )
    return dict(sorted(usable_d.items())), usable_p, incompatible_pairs


def _engine_incompatible(
    v: _Verdicts,
    engine: _Engine,
    other: _Engine,
    fail: tuple[int, int, Any],
    n_other: int,
    decode_side: _Engine | None = None,
) -> None:
    d_rank, p_rank, problem = fail
    d, p = (decode_side, engine) if decode_side is not None else (engine, other)
    culprit = engine.ranks[p_rank if decode_side is not None else d_rank]
    versus = other.ranks[d_rank if decode_side is not None else p_rank]
    noun = "decode" if engine.role == PREFILL else "prefill"
    if isinstance(problem, GeometryError):
        rule, field, text = "tp_size", "spec.tpSize", str(problem)
    else:
        rule, field, text = str(problem.rule), endpoint_field(problem.field), problem.message
    message = (
        f"incompatible with every {noun} engine ({n_other}); decode {d.ranks[d_rank].name} vs "
        f"prefill {p.ranks[p_rank].name}: {text}"
    )
    for e in engine.ranks:
        if e is culprit:
            v.incompatible(e, rule, field, message)
        else:
            v.set(
                e,
                EndpointState.INCOMPATIBLE,
                "EngineIncompatible",
                f"rank {culprit.tp_rank} of engine {engine.engine_id} ({culprit.name}) is "
                f"incompatible with every {noun} engine; vs {versus.name}",
            )


class _LoadHeaps:
    """Least-loaded prefill engine per candidate set; lazy entries (loads only grow)."""

    def __init__(self, load: dict[str, int]) -> None:
        self.load = load
        self.heaps: dict[Any, list[tuple[int, str]]] = {}

    def best(self, key: Any, ids: Iterable[str], exclude: set[str]) -> str | None:
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = [(self.load[i], i) for i in ids]
            heapq.heapify(heap)
        held: list[tuple[int, str]] = []
        found = None
        while heap:
            load, pid = heap[0]
            if load != self.load[pid]:
                heapq.heapreplace(heap, (self.load[pid], pid))
            elif pid in exclude:
                held.append(heapq.heappop(heap))
            else:
                found = pid
                break
        for item in held:
            heapq.heappush(heap, item)
        return found


def _pair(
    transfer: Transfer,
    usable_d: dict[str, tuple[_Engine, _Candidates]],
    usable_p: dict[str, _Engine],
    node_labels: Mapping[str, Mapping[str, str]],
) -> dict[str, list[str]]:
    """Assign prefill engines to each usable decode engine (module docstring, step 6).

    Sticky first: a decode engine keeps the prefill engines it had (read from its endpoints'
    status) while they stay compatible, under the balance cap and, for TopologyAware, local
    when a local candidate exists. Then least-loaded fill, local candidates first. Candidate
    lists are per decode class, so the cost stays linear in the number of engines.
    """
    topo_key = transfer.topology_key if transfer.policy == "TopologyAware" else ""

    def topo(e: _Engine) -> str | None:
        node = e.ranks[0].node_name
        return (node_labels.get(node) or {}).get(topo_key) if topo_key and node else None

    k = transfer.prefill_per_decode
    want = {d: min(k, len(g.ids)) for d, (_, g) in usable_d.items()}
    groups = {g.index: g for _, g in usable_d.values()}
    reachable = set().union(*(g.members for g in groups.values()))
    cap = math.ceil(sum(want.values()) / len(reachable)) if reachable else 0
    load = dict.fromkeys(usable_p, 0)
    p_topo = {p: topo(e) for p, e in usable_p.items()}
    local_ids: dict[tuple[int, str | None], list[str]] = {}
    where: dict[str, str | None] = {}
    assigned: dict[str, list[str]] = {d: [] for d in usable_d}
    for d, (engine, g) in usable_d.items():
        w = where[d] = topo(engine)
        if (g.index, w) not in local_ids:
            local_ids[(g.index, w)] = [p for p in g.ids if w is not None and p_topo[p] == w]
        has_local = bool(local_ids[(g.index, w)])
        for p in sorted({p for e in engine.ranks for p in e.previous_peer_engines}):
            if (
                len(assigned[d]) < want[d]
                and p in g.members
                and (not has_local or p_topo[p] == w)
                and load[p] < cap
            ):
                assigned[d].append(p)
                load[p] += 1
    heaps = _LoadHeaps(load)
    for d, (_, g) in usable_d.items():
        local = local_ids[(g.index, where[d])]
        while len(assigned[d]) < want[d]:
            taken = set(assigned[d])
            pick = heaps.best(("local", g.index, where[d]), local, taken) if local else None
            if pick is None or load[pick] >= cap:
                alt = heaps.best(("any", g.index), g.ids, taken)
                if pick is None or (alt is not None and load[alt] < load[pick]):
                    pick = alt
            if pick is None:
                break
            assigned[d].append(pick)
            load[pick] += 1
    return {d: sorted(ps) for d, ps in assigned.items()}


def _peers_and_handshakes(
    usable_d: dict[str, tuple[_Engine, _Candidates]],
    usable_p: dict[str, _Engine],
    assignment: dict[str, list[str]],
    v: _Verdicts,
    *,
    push: bool = False,
) -> list[Pair]:
    """Rank-level peers (spec §1.9), handshake verification, endpoint verdicts, pairs.

    A pair is verified by the decode rank's report on the prefill rank; in push mode the
    prefill rank writes into the decode rank's memory, so its report on the decode rank is
    needed too.
    """
    p_peers: dict[str, list[Peer]] = defaultdict(list)
    pairs: list[Pair] = []
    reports = {
        e.name: {(h.peer, h.epoch): h for h in e.handshakes}
        for engine in (*(d for d, _ in usable_d.values()), *usable_p.values())
        for e in engine.ranks
    }
    for d_id, (d, _) in usable_d.items():
        states: dict[str, list[PairState]] = defaultdict(list)
        for e in d.ranks:
            peers: list[Peer] = []
            per_rank: list[PairState] = []
            failures: list[tuple[str, Handshake]] = []
            for p_id in assignment[d_id]:
                p = usable_p[p_id]
                results = []
                for t in handshake_target_ranks(e.tp_rank, d.tp_size, p.tp_size):
                    pe = p.ranks[t]
                    peers.append(_peer(pe, p.tp_size))
                    p_peers[pe.name].append(_peer(e, d.tp_size))
                    sides = [(e.name, reports[e.name].get((pe.name, pe.epoch)))]
                    if push:
                        sides.append((pe.name, reports[pe.name].get((e.name, e.epoch))))
                    for reporter, h in sides:
                        results.append(_reported(h))
                        if h is not None and not h.succeeded:
                            failures.append((reporter, h))
                state = _combine(results)
                states[p_id].append(state)
                per_rank.append(state)
            if peers:
                state = _combine(per_rank)
                reason, message = _handshake_text(state, peers, failures, push=push)
                v.items[e.name] = EndpointPlan(
                    e.name, e.role, EndpointState.PAIRED, reason, message, tuple(peers), state
                )
            else:
                v.set(
                    e,
                    EndpointState.UNPAIRED,
                    "NoPrefillEngines",
                    "no compatible prefill engine is available",
                )
        pairs.extend(Pair(d_id, p_id, _combine(states[p_id])) for p_id in assignment[d_id])
    for p_id, p in usable_p.items():
        for e in p.ranks:
            peers = sorted(p_peers.get(e.name, ()), key=lambda x: (x.engine_id, x.tp_rank))
            if peers:
                v.items[e.name] = EndpointPlan(
                    e.name,
                    e.role,
                    EndpointState.PAIRED,
                    "Paired",
                    f"serving {len(peers)} decode rank(s) of "
                    f"{len({x.engine_id for x in peers})} engine(s)",
                    tuple(peers),
                )
            else:
                v.set(
                    e,
                    EndpointState.UNPAIRED,
                    "NoDecodeAssigned",
                    f"no decode engine is assigned to prefill engine {p_id}",
                )
    return sorted(pairs, key=lambda x: (x.decode_engine, x.prefill_engine))


def _peer(e: Endpoint, tp_size: int) -> Peer:
    return Peer(e.name, e.engine_id, e.role, e.host, e.port, e.tp_rank, tp_size, e.epoch)


def _combine(states: list[PairState]) -> PairState:
    if PairState.FAILED in states:
        return PairState.FAILED
    if states and all(s is PairState.VERIFIED for s in states):
        return PairState.VERIFIED
    return PairState.PENDING


def _reported(h: Handshake | None) -> PairState:
    if h is None:
        return PairState.PENDING
    return PairState.VERIFIED if h.succeeded else PairState.FAILED


def _handshake_text(
    state: PairState, peers: list[Peer], failures: list[tuple[str, Handshake]], *, push: bool
) -> tuple[str, str]:
    names = ", ".join(p.name for p in peers)
    if state is PairState.VERIFIED:
        return "HandshakesSucceeded", f"handshakes with {names} succeeded"
    if state is PairState.FAILED:
        reporter, h = failures[0]
        return (
            "HandshakeFailed",
            f"handshake of {reporter} with {h.peer} (epoch {h.epoch}) failed: {h.message}",
        )
    where = "status.handshakes of both sides" if push else "status.handshakes"
    return "HandshakePending", f"waiting for {where} to report {names} at their epochs"


def _counts(role: str, eps: list[Endpoint], v: _Verdicts, engines: int) -> RoleCounts:
    plans = [v.items[e.name] for e in eps if e.role == role and e.name in v.items]
    by_name = v.items

    def verified(ep: EndpointPlan) -> bool:
        if ep.state is not EndpointState.PAIRED:
            return False
        if role == DECODE:
            return ep.handshake is PairState.VERIFIED
        return all(by_name[p.name].handshake is PairState.VERIFIED for p in ep.peers)

    return RoleCounts(
        engines=engines,
        endpoints=len(plans),
        incompatible=sum(p.state is EndpointState.INCOMPATIBLE for p in plans),
        stale=sum(p.state is EndpointState.STALE for p in plans),
        incomplete=sum(p.reason == "EngineIncomplete" for p in plans),
        paired=sum(p.state is EndpointState.PAIRED for p in plans),
        verified=sum(verified(p) for p in plans),
    )


def _compatible_engines(engines: dict[str, _Engine], v: _Verdicts) -> int:
    """Complete engines not found incompatible (paired, or waiting for a peer)."""
    return sum(
        1
        for e in engines.values()
        if v.items[e.ranks[0].name].state is not EndpointState.INCOMPATIBLE
    )


def _finish(
    transfer: Transfer,
    eps: list[Endpoint],
    v: _Verdicts,
    engines: dict[str, dict[str, _Engine]],
    pairs: list[Pair],
    incompatible_pairs: int,
) -> Plan:
    for e in eps:  # anything not decided yet (cannot happen today; keeps the plan total)
        if e.name not in v.items:
            v.set(e, EndpointState.PENDING, "Pending", "not planned yet")
    prefill = _counts(PREFILL, eps, v, _compatible_engines(engines[PREFILL], v))
    decode = _counts(DECODE, eps, v, _compatible_engines(engines[DECODE], v))
    problems = sorted(v.problems, key=lambda p: p.endpoint)
    plans = [v.items[e.name] for e in eps]
    conditions = desired_conditions(transfer, eps, plans, problems, prefill, decode, pairs)
    verified = sum(p.state is PairState.VERIFIED for p in pairs)
    summary = f"{prefill.engines} prefill / {decode.engines} decode engines, "
    summary += f"{verified}/{len(pairs)} pairs verified"
    notes = [
        c
        for c in conditions
        if (c.type == "Ready" and c.status != "True")
        or (c.type == "Degraded" and c.status == "True")
    ]
    if notes:
        summary += "; " + "; ".join(f"{c.reason}: {c.message}" for c in notes)
    return Plan(
        endpoints=tuple(plans),
        pairs=tuple(pairs),
        prefill=prefill,
        decode=decode,
        problems=tuple(problems),
        incompatible_pairs=incompatible_pairs,
        conditions=conditions,
        summary=summary[:1000],
    )
