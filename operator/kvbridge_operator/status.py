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

from .config import MAX_PEERS
from .planner import DesiredCondition, EndpointPlan, EndpointState, Plan
from .spec import Endpoint

#: KVEndpoint status keys the operator owns.
ENDPOINT_KEYS = ("observedGeneration", "observedEpoch", "state", "reason", "message", "peers")
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
    previous = {c.get("type"): c for c in old or () if isinstance(c, Mapping)}
    result = []
    for d in desired:
        prev = previous.get(d.type)
        same = prev is not None and prev.get("status") == d.status
        result.append(
            {
                "type": d.type,
                "status": d.status,
                "reason": d.reason,
                "message": d.message[:MAX_CONDITION_MESSAGE],
                "lastTransitionTime": prev.get("lastTransitionTime", now) if same else now,
                "observedGeneration": generation,
            }
        )
    return result


def transitions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Conditions whose status differs from before (new conditions count, Unknown does not)."""
    previous = {c.get("type"): c.get("status") for c in old or () if isinstance(c, Mapping)}
    return [
        c
        for c in new
        if previous.get(c["type"]) != c["status"]
        and not (c["status"] == "Unknown" and c["type"] not in previous)
    ]


def transfer_status(
    plan: Plan, old: Mapping[str, Any] | None, *, generation: int, now: str
) -> dict[str, Any]:
    """The whole KVTransfer ``status`` for ``plan``."""
    old = old or {}
    return {
        "observedGeneration": generation,
        "summary": plan.summary,
        "prefill": asdict(plan.prefill),
        "decode": asdict(plan.decode),
        "pairs": {
            "total": len(plan.pairs),
            "verified": plan.verified_pairs,
            "items": [
                {
                    "decodeEngine": p.decode_engine,
                    "prefillEngine": p.prefill_engine,
                    "state": str(p.state),
                    **({"transports": [t[:MAX_TRANSPORT_NAME]
                                       for t in p.transports[:MAX_PAIR_TRANSPORTS]]}
                       if p.transports else {}),
                }
                for p in plan.pairs[:MAX_PAIRS_LISTED]
            ],
        },
        "incompatible": [
            {
                "endpoint": p.endpoint,
                "role": p.role,
                "rule": p.rule,
                "field": p.field[:MAX_PROBLEM_FIELD],
                "message": p.message[:MAX_PROBLEM_MESSAGE],
            }
            for p in plan.problems[:MAX_PROBLEMS_LISTED]
        ],
        "conditions": merge_conditions(
            old.get("conditions"), plan.conditions, now=now, generation=generation
        ),
    }


def invalid_transfer_status(
    old: Mapping[str, Any] | None, *, generation: int, now: str, message: str
) -> dict[str, Any]:
    """Status for a KVTransfer whose spec cannot be parsed (admission was bypassed)."""
    old = old or {}
    desired = [
        DesiredCondition("Ready", "False", "InvalidSpec", message),
        DesiredCondition("Degraded", "True", "InvalidSpec", message),
    ]
    return {
        "observedGeneration": generation,
        "summary": f"InvalidSpec: {message}"[:1000],
        "conditions": merge_conditions(
            old.get("conditions"), desired, now=now, generation=generation
        ),
    }


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
    return {
        "observedGeneration": endpoint.generation,
        "observedEpoch": endpoint.epoch,
        "state": str(verdict.state),
        "reason": verdict.reason,
        "message": message[:MAX_ENDPOINT_MESSAGE],
        "peers": [p.to_dict() for p in verdict.peers[:MAX_PEERS_LISTED]],
    }


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
    return {
        "observedGeneration": endpoint.generation,
        "observedEpoch": endpoint.epoch,
        "state": str(EndpointState.ORPHANED),
        "reason": reason,
        "message": f"{why}; this endpoint stays idle until a KVTransfer {t} is created there",
        "peers": [],
    }


def orphaned_status_for(endpoint: Endpoint) -> dict[str, Any]:
    """The orphan status to keep for ``endpoint``: ``TransferDeleted`` stays while its spec
    is unchanged (the more specific story), anything else becomes ``TransferNotFound``."""
    stored = endpoint.status or {}
    deleted = (
        stored.get("state") == EndpointState.ORPHANED
        and stored.get("reason") == "TransferDeleted"
        and stored.get("observedGeneration") == endpoint.generation
    )
    return orphaned_endpoint_status(endpoint, deleted=deleted)


def owned_part(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The operator-owned keys of a KVEndpoint status (for comparison)."""
    status = status or {}
    return {k: status[k] for k in ENDPOINT_KEYS if k in status}
