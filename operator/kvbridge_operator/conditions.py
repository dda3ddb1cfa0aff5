"""Desired KVTransfer conditions from a finished plan. Pure.

GeometryCompatible, Paired, HandshakesVerified, Ready (Paired and HandshakesVerified; an
incompatible endpoint that is left out does not block it) and Degraded (incompatible, stale or
incomplete endpoints, failed handshakes, pairs over a transport the KVTransfer does not
accept) and RevisionsMatched (every model revision has engines of both roles; see
:mod:`.revisions`). Messages name endpoints and fields and list at most a
few names, sorted, so they only change when the facts do.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge_agent.resources import ConditionStatus as CS
from kvbridge_agent.resources import ConditionType as CT

from .config import DECODE
from .eligibility import NODE_NOT_READY
from .model import (
    DesiredCondition,
    EndpointPlan,
    EndpointState,
    Pair,
    PairState,
    Problem,
    RoleCounts,
    TransportFallback,
)
from .revisions import RevisionCount, revisions_condition
from .spec import Endpoint, Transfer


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def desired_conditions(
    transfer: Transfer,
    eps: list[Endpoint],
    plans: list[EndpointPlan],
    problems: list[Problem],
    prefill: RoleCounts,
    decode: RoleCounts,
    pairs: list[Pair],
    fallbacks: list[TransportFallback] | None = None,
    revisions: Sequence[RevisionCount] = (),
) -> tuple[DesiredCondition, ...]:
    C = DesiredCondition
    if not eps:
        geo = C(
            CT.GEOMETRY_COMPATIBLE,
            CS.UNKNOWN,
            "NoEndpoints",
            f"no KVEndpoint has spec.transferName {transfer.name}",
        )
    elif problems:
        shown = "; ".join(f"{p.role} {p.endpoint}: {p.field}: {p.message}" for p in problems[:3])
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        geo = C(
            CT.GEOMETRY_COMPATIBLE,
            CS.FALSE,
            "IncompatibleEndpoints",
            f"{len(problems)} endpoint(s) not paired: {shown}{more}",
        )
    elif not prefill.engines or not decode.engines:
        geo = C(
            CT.GEOMETRY_COMPATIBLE,
            CS.UNKNOWN,
            "WaitingForEngines",
            "need one complete prefill and one complete decode engine to compare",
        )
    else:
        geo = C(
            CT.GEOMETRY_COMPATIBLE,
            CS.TRUE,
            "AllCompatible",
            f"{decode.engines} decode and {prefill.engines} prefill engines pass the "
            "handshake rules",
        )
    if not decode.engines:
        paired = C(
            CT.PAIRED,
            CS.FALSE,
            "NoDecodeEngines",
            "no complete, compatible decode engine (see KVEndpoint status)",
        )
    elif not pairs:
        paired = C(
            CT.PAIRED,
            CS.FALSE,
            "NoPrefillEngines",
            "no complete, compatible prefill engine (see KVEndpoint status)",
        )
    else:
        used = len({p.prefill_engine for p in pairs})
        paired = C(
            CT.PAIRED,
            CS.TRUE,
            "AllDecodeEnginesPaired",
            f"{decode.engines} decode engine(s) paired with {used} prefill engine(s), "
            f"policy {transfer.policy}",
        )
    d_paired = [p for p in plans if p.role == DECODE and p.state is EndpointState.PAIRED]
    failed = [p for p in d_paired if p.handshake is PairState.FAILED]
    pending = [p.name for p in d_paired if p.handshake is PairState.PENDING]
    if not pairs:
        hs = C(CT.HANDSHAKES_VERIFIED, CS.UNKNOWN, "NoPairs", "no pairs are assigned yet")
    elif failed:
        hs = C(
            CT.HANDSHAKES_VERIFIED,
            CS.FALSE,
            "HandshakeFailed",
            f"{len(failed)} decode endpoint(s) report failed handshakes: "
            + "; ".join(f"{p.name}: {p.message}" for p in failed[:3]),
        )
    elif pending:
        hs = C(
            CT.HANDSHAKES_VERIFIED,
            CS.FALSE,
            "HandshakesPending",
            f"{len(pending)} of {len(d_paired)} paired decode endpoints have not reported "
            f"successful handshakes at their peers' current epochs: {_names(pending)}",
        )
    else:
        hs = C(
            CT.HANDSHAKES_VERIFIED,
            CS.TRUE,
            "AllHandshakesSucceeded",
            f"{len(d_paired)} decode endpoints verified {len(pairs)} pair(s)",
        )
    if paired.status == CS.TRUE and hs.status == CS.TRUE:
        ready = C(CT.READY, CS.TRUE, "AllPairsVerified", f"{len(pairs)} pair(s) ready")
    else:
        blocker = paired if paired.status != CS.TRUE else hs
        ready = C(CT.READY, CS.FALSE, blocker.reason, blocker.message)
    parts = []
    if problems:
        parts.append(
            (
                "IncompatibleEndpoints",
                f"{len(problems)} incompatible endpoint(s): "
                f"{_names([p.endpoint for p in problems])}",
            )
        )
    if failed:
        parts.append(("HandshakeFailed", f"{len(failed)} failed handshake(s)"))
    if fallbacks:
        shown = "; ".join(f"{f.endpoint} <- {f.peer} over {f.transport}" for f in fallbacks[:3])
        more = f"; and {len(fallbacks) - 3} more" if len(fallbacks) > 3 else ""
        accepted = ", ".join(transfer.accepted_transports)
        parts.append(("TransportFallback",
                      f"{len(fallbacks)} rank pair(s) use a transport outside "
                      f"spec.transport.accepted [{accepted}]: {shown}{more}"))
    lost = [p.name for p in plans if p.reason == NODE_NOT_READY]
    if lost:
        on_lost = set(lost)
        nodes = sorted({e.node_name for e in eps if e.name in on_lost})
        parts.append((NODE_NOT_READY,
                      f"{len(lost)} endpoint(s) lost their pairs on node(s) not Ready "
                      f"({_names(nodes)}): {_names(lost)}"))
    stale = prefill.stale + decode.stale
    if stale:
        parts.append(("StaleEndpoints", f"{stale} stale endpoint(s) superseded by newer epochs"))
    incomplete = prefill.incomplete + decode.incomplete
    if incomplete:
        parts.append(("IncompleteEngines", f"{incomplete} endpoint(s) of engines missing TP ranks"))
    if parts:
        degraded = C(CT.DEGRADED, CS.TRUE, parts[0][0], "; ".join(m for _, m in parts))
    else:
        degraded = C(
            CT.DEGRADED,
            CS.FALSE,
            "AsExpected",
            "no incompatible, stale or incomplete endpoints, no endpoint on a lost node, no "
            "failed handshakes and no transport fallback",
        )
    return (geo, paired, hs, ready, degraded, revisions_condition(revisions))
