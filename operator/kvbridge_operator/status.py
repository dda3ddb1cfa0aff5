"""Plan -> status documents, with Kubernetes condition conventions. Pure (the clock is passed in).

- ``lastTransitionTime`` changes only when a condition's status changes;
- ``observedGeneration`` is the generation the plan was computed for;
- only operator-owned KVEndpoint status fields are produced (``status.handshakes`` belongs to
  the agent and is never written here), so a merge patch cannot clobber the agent's writes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from kvbridge_agent.resources import (
    CONDITION_FIELDS,
    ENDPOINT_STATUS_FIELDS,
    OPERATOR_STATUS_KEYS,
    PAIR_FIELDS,
    PAIRS_FIELDS,
    PROBLEM_FIELDS,
    REVISION_FIELDS,
    ROLE_COUNT_FIELDS,
    TRANSFER_STATUS_FIELDS,
    ConditionStatus,
    ConditionType,
    document,
)

from .config import MAX_PEERS
from .planner import DesiredCondition, EndpointPlan, EndpointState, Plan
from .revisions import MAX_REVISIONS_LISTED
from .spec import Endpoint

#: KVEndpoint status keys the operator owns.
ENDPOINT_KEYS = OPERATOR_STATUS_KEYS
_C = CONDITION_FIELDS
#: Bounds of the CRDs' status fields (each written value is cut to them, never refused).
MAX_PAIRS_LISTED = 1000
MAX_PROBLEMS_LISTED = 100
MAX_PEERS_LISTED = MAX_PEERS
MAX_ENDPOINT_MESSAGE = 4000  # schema: 4096
MAX_CONDITION_MESSAGE = 4096
MAX_PROBLEM_MESSAGE = 1024
MAX_PROBLEM_FIELD = 256
MAX_PAIR_TRANSPORTS = 3  # status.pairs.items[].transports maxItems
MAX_TRANSPORT_NAME = 32  # ... and each one's maxLength


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None,
    desired: Iterable[DesiredCondition],
    *,
    now: str,
    generation: int,
) -> list[dict[str, Any]]:
    """New condition list; keeps ``lastTransitionTime`` when the status did not change."""
    previous = {_C.type.get(c): c for c in old or () if isinstance(c, Mapping)}
    result = []
    for d in desired:
        prev = previous.get(d.type)
        same = prev is not None and _C.status.get(prev) == d.status
        since = prev.get(_C.last_transition_time.key, now) if same else now  # type: ignore[union-attr]
        result.append(document(_C, {
            "type": str(d.type),
            "status": str(d.status),
            "reason": d.reason,
            "message": d.message[:MAX_CONDITION_MESSAGE],
            "last_transition_time": since,
            "observed_generation": generation,
        }))
    return result


def transitions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Conditions whose status differs from before (new conditions count, Unknown does not)."""
    previous = {_C.type.get(c): _C.status.get(c) for c in old or () if isinstance(c, Mapping)}
    return [
        c
        for c in new
        if previous.get(_C.type.at(c)) != _C.status.at(c)
        and not (_C.status.at(c) == ConditionStatus.UNKNOWN and _C.type.at(c) not in previous)
    ]


def transfer_status(
    plan: Plan, old: Mapping[str, Any] | None, *, generation: int, now: str
) -> dict[str, Any]:
    """The whole KVTransfer ``status`` for ``plan``."""
    old = old or {}
    pairs = [
        document(PAIR_FIELDS, {
            "decode_engine": p.decode_engine,
            "prefill_engine": p.prefill_engine,
            "state": str(p.state),
            **({"transports": [t[:MAX_TRANSPORT_NAME] for t in p.transports[:MAX_PAIR_TRANSPORTS]]}
               if p.transports else {}),
        })
        for p in plan.pairs[:MAX_PAIRS_LISTED]
    ]
    problems = [
        document(PROBLEM_FIELDS, {
            "endpoint": p.endpoint,
            "role": p.role,
            "rule": p.rule,
            "field": p.field[:MAX_PROBLEM_FIELD],
            "message": p.message[:MAX_PROBLEM_MESSAGE],
        })
        for p in plan.problems[:MAX_PROBLEMS_LISTED]
    ]
    conditions = TRANSFER_STATUS_FIELDS.conditions
    return document(TRANSFER_STATUS_FIELDS, {
        "observed_generation": generation,
        "summary": plan.summary,
        "prefill": document(ROLE_COUNT_FIELDS, asdict(plan.prefill)),
        "decode": document(ROLE_COUNT_FIELDS, asdict(plan.decode)),
        "pairs": document(PAIRS_FIELDS, {
            "total": len(plan.pairs), "verified": plan.verified_pairs, "listed": pairs}),
        "incompatible": problems,
        "revisions": [document(REVISION_FIELDS, r.to_dict())
                      for r in plan.revisions[:MAX_REVISIONS_LISTED]],
        "conditions": merge_conditions(
            conditions.get(old), plan.conditions, now=now, generation=generation
        ),
    })


def invalid_transfer_status(
    old: Mapping[str, Any] | None, *, generation: int, now: str, message: str
) -> dict[str, Any]:
    """Status for a KVTransfer whose spec cannot be parsed (admission was bypassed)."""
    old = old or {}
    desired = [
        DesiredCondition(ConditionType.READY, ConditionStatus.FALSE, "InvalidSpec", message),
        DesiredCondition(ConditionType.DEGRADED, ConditionStatus.TRUE, "InvalidSpec", message),
    ]
    return document(TRANSFER_STATUS_FIELDS, {
        "observed_generation": generation,
        "summary": f"InvalidSpec: {message}"[:1000],
        "conditions": merge_conditions(
            TRANSFER_STATUS_FIELDS.conditions.get(old), desired, now=now, generation=generation
        ),
    })


def endpoint_status(verdict: EndpointPlan, endpoint: Endpoint) -> dict[str, Any]:
    """Operator-owned KVEndpoint status for one verdict.

    ``status.peers`` holds at most :data:`MAX_PEERS_LISTED` (so that the largest KVEndpoint
    stays storable); beyond that the first ones are listed and the message says how many
    were assigned, so the unlisted pairs visibly stay unverified instead of the write failing.
    """
    message = verdict.message
    if len(verdict.peers) > MAX_PEERS_LISTED:
        message = (
            f"{len(verdict.peers)} peers assigned, only the first {MAX_PEERS_LISTED} are "
            f"listed in status.peers (its limit); pairs with the others stay unverified: "
            f"{message}"
        )
    return document(ENDPOINT_STATUS_FIELDS, {
        "observed_generation": endpoint.generation,
        "observed_epoch": endpoint.epoch,
        "state": str(verdict.state),
        "reason": verdict.reason,
        "message": message[:MAX_ENDPOINT_MESSAGE],
        "peers": [p.to_dict() for p in verdict.peers[:MAX_PEERS_LISTED]],
    })


def orphaned_endpoint_status(endpoint: Endpoint, *, deleted: bool = False) -> dict[str, Any]:
    """Status for an endpoint whose ``spec.transferName`` names no KVTransfer: no peers.

    ``deleted`` says the KVTransfer existed and was deleted (reason ``TransferDeleted``);
    otherwise it was never found (``TransferNotFound``).
    """
    t, ns = endpoint.transfer, endpoint.namespace
    if deleted:
        reason = "TransferDeleted"
        why = f"KVTransfer {t} (spec.transferName) in namespace {ns} was deleted; peers withdrawn"
    else:
        reason = "TransferNotFound"
        why = f"no KVTransfer named {t} (spec.transferName) exists in namespace {ns}"
    return document(ENDPOINT_STATUS_FIELDS, {
        "observed_generation": endpoint.generation,
        "observed_epoch": endpoint.epoch,
        "state": str(EndpointState.ORPHANED),
        "reason": reason,
        "message": f"{why}; this endpoint stays idle until a KVTransfer {t} is created there",
        "peers": [],
    })


def orphaned_status_for(endpoint: Endpoint) -> dict[str, Any]:
    """The orphan status to keep for ``endpoint``: ``TransferDeleted`` stays while its spec
    is unchanged (the more specific story), anything else becomes ``TransferNotFound``."""
    stored = endpoint.status or {}
    own = ENDPOINT_STATUS_FIELDS
    deleted = (
        own.state.get(stored) == EndpointState.ORPHANED
        and own.reason.get(stored) == "TransferDeleted"
        and own.observed_generation.get(stored) == endpoint.generation
    )
    return orphaned_endpoint_status(endpoint, deleted=deleted)


def owned_part(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The operator-owned keys of a KVEndpoint status (for comparison)."""
    status = status or {}
    return {k: status[k] for k in ENDPOINT_KEYS if k in status}
