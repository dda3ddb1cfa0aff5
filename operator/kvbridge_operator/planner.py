"""The planner: one KVTransfer and its KVEndpoints in, pairing and verdicts out.

Pure and deterministic: no kopf, no Kubernetes client, no clock. The same input (including
the peers the operator assigned last time, read back from the endpoints' status) gives the
same :class:`Plan`, with stable ordering, so a restarted operator reproduces it exactly.

Steps, in order, one module each:

1. :mod:`.eligibility`: exclusion (terminating, not selected), staleness (per engine rank
   only the highest epoch counts), checks against the KVTransfer (mode, TP size, protocol
   version, expected geometry) and complete engines;
2. :mod:`.compatibility`: every decode rank against the prefill ranks it handshakes with,
   through the agent's own ``validate_remote``, memoised on geometry classes;
3. :mod:`.pairing`: each decode engine gets ``prefillPerDecode`` compatible prefill engines;
4. here: rank-level peers, handshake verification (agent-reported results at the peer's
   current epoch), counts (per model revision too, :mod:`.revisions`) and the desired
   conditions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from kvbridge_agent.geometry import handshake_target_ranks
from kvbridge_agent.resources import TOPOLOGY_AWARE, ConditionStatus, ConditionType
from kvbridge_agent.rules import transport_accepted

from .compatibility import Candidates, classify
from .conditions import desired_conditions
from .config import DECODE, PREFILL
from .eligibility import Engine, Verdicts, eligible_engines
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
    TransportFallback,
    endpoint_field,
)
from .pairing import assign
from .revisions import revision_counts
from .spec import Endpoint, Handshake, Transfer

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
    "TransportFallback",
    "endpoint_field",
    "plan",
]


def plan(
    transfer: Transfer,
    endpoints: Iterable[Endpoint],
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
    lost_nodes: frozenset[str] = frozenset(),
) -> Plan:
    """Plan one KVTransfer; see the module docstring. Endpoints on ``lost_nodes`` (Ready
    condition not True) are excluded, so their pairs are dropped until the node is back. Pure."""
    v = Verdicts()
    eps = sorted((e for e in endpoints if e.transfer == transfer.name), key=lambda e: e.name)
    engines = eligible_engines(transfer, eps, v, lost_nodes)
    usable = classify(engines, transfer, v)
    assignment = assign(transfer, usable.decode, usable.prefill, node_labels or {})
    pairs, fallbacks = _peers_and_handshakes(transfer, usable.decode, usable.prefill,
                                             assignment, v, node_labels or {})  # fmt: skip
    return _finish(transfer, eps, v, engines, pairs, usable.incompatible_pairs, fallbacks)


def _peers_and_handshakes(
    transfer: Transfer,
    usable_d: dict[str, tuple[Engine, Candidates]],
    usable_p: dict[str, Engine],
    assignment: dict[str, list[str]],
    v: Verdicts,
    node_labels: Mapping[str, Mapping[str, str]],
) -> tuple[list[Pair], list[TransportFallback]]:
    """Rank-level peers (spec §1.9), handshake verification, endpoint verdicts, pairs with
    the transports their decode ranks report, and the rank pairs whose transport
    ``spec.transport.accepted`` leaves out.

    A pair is verified by the decode rank's report on the prefill rank; in push mode the
    prefill rank writes into the decode rank's memory, so its report on the decode rank is
    needed too.
    """
    push = transfer.mode == "push"
    p_peers: dict[str, list[Peer]] = defaultdict(list)
    pairs: list[Pair] = []
    fallbacks: list[TransportFallback] = []
    reports = {
        e.name: {(h.peer, h.epoch): h for h in e.handshakes}
        for engine in (*(d for d, _ in usable_d.values()), *usable_p.values())
        for e in engine.ranks
    }
    for d_id, (d, candidates) in usable_d.items():
        states: dict[str, list[PairState]] = defaultdict(list)
        transports: dict[str, set[str]] = defaultdict(set)
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
                    reported = reports[e.name].get((pe.name, pe.epoch))
                    if reported is not None and reported.succeeded and reported.transport:
                        transports[p_id].add(reported.transport)
                        if not transport_accepted(reported.transport,
                                                  transfer.accepted_transports):  # fmt: skip
                            fallbacks.append(TransportFallback(e.name, pe.name,
                                                               reported.transport))
                    sides = [(e.name, reported)]
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
                v.set(e, EndpointState.UNPAIRED,
                      *_unpaired(transfer, e, candidates, node_labels))  # fmt: skip
        pairs.extend(Pair(d_id, p_id, _combine(states[p_id]), tuple(sorted(transports[p_id])))
                     for p_id in assignment[d_id])  # fmt: skip
    for p_id, p in usable_p.items():
        for e in p.ranks:
            peers = sorted(p_peers.get(e.name, ()), key=lambda x: (x.engine_id, x.tp_rank))
            if peers:
                v.items[e.name] = EndpointPlan(
                    e.name,
                    e.role,
                    EndpointState.PAIRED,
                    str(EndpointState.PAIRED),  # the reason: the state itself
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
    pairs.sort(key=lambda x: (x.decode_engine, x.prefill_engine))
    return pairs, sorted(fallbacks, key=lambda f: (f.endpoint, f.peer))


def _unpaired(
    transfer: Transfer,
    e: Endpoint,
    candidates: Candidates,
    node_labels: Mapping[str, Mapping[str, str]],
) -> tuple[str, str]:
    """Why decode rank ``e`` got no prefill engine: none is compatible, or (with
    ``topologyScope: Required``, the one way compatible engines go unassigned) none is in
    its zone."""
    required = transfer.policy == TOPOLOGY_AWARE and transfer.topology_required
    if not candidates.ids or not required:
        return "NoPrefillEngines", "no compatible prefill engine is available"
    key = transfer.topology_key
    value = (node_labels.get(e.node_name) or {}).get(key) if e.node_name else None
    where = f"{key}={value}" if value is not None else f"no {key} label on its node"
    return ("NoPrefillInTopology",
            f"no compatible prefill engine shares its topology ({where}), and "
            "spec.pairing.topologyScope is Required: it is not paired across "
            f"{key} values ({len(candidates.ids)} compatible elsewhere)")


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


def _counts(role: str, eps: list[Endpoint], v: Verdicts, engines: int) -> RoleCounts:
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


def _compatible_engines(engines: dict[str, Engine], v: Verdicts) -> int:
    """Complete engines not found incompatible (paired, or waiting for a peer)."""
    return sum(
        1
        for e in engines.values()
        if v.items[e.ranks[0].name].state is not EndpointState.INCOMPATIBLE
    )


def _finish(
    transfer: Transfer,
    eps: list[Endpoint],
    v: Verdicts,
    engines: dict[str, dict[str, Engine]],
    pairs: list[Pair],
    incompatible_pairs: int,
    fallbacks: list[TransportFallback],
) -> Plan:
    for e in eps:  # anything not decided yet (cannot happen today; keeps the plan total)
        if e.name not in v.items:
            v.set(e, EndpointState.PENDING, str(EndpointState.PENDING), "not planned yet")
    prefill = _counts(PREFILL, eps, v, _compatible_engines(engines[PREFILL], v))
    decode = _counts(DECODE, eps, v, _compatible_engines(engines[DECODE], v))
    problems = sorted(v.problems, key=lambda p: p.endpoint)
    plans = [v.items[e.name] for e in eps]
    revisions = revision_counts(((role, e.engine_id, e.identity)
                                 for role in (PREFILL, DECODE) for e in engines[role].values()),
                                pairs)  # fmt: skip
    conditions = desired_conditions(transfer, eps, plans, problems, prefill, decode, pairs,
                                    fallbacks, revisions)  # fmt: skip
    verified = sum(p.state is PairState.VERIFIED for p in pairs)
    summary = f"{prefill.engines} prefill / {decode.engines} decode engines, "
    summary += f"{verified}/{len(pairs)} pairs verified"
    notes = [
        c
        for c in conditions
        if (c.type == ConditionType.READY and c.status != ConditionStatus.TRUE)
        or (c.type == ConditionType.DEGRADED and c.status == ConditionStatus.TRUE)
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
        fallbacks=tuple(fallbacks),
        revisions=revisions,
    )
