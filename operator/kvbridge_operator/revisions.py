"""Model identity: which weights an engine serves, the pairing rule on it, and the per-revision
counts and condition of a KVTransfer. Pure.

The compatibility hash covers a model's name, dtype and shapes but not its weights, so two
Deployments loading different weights under one name would pass it and answer wrong tokens.
Engines pair only within one identity: equal ``spec.model.fingerprint`` (empty only with
empty: agents that publish none) and equal ``spec.model.revision`` where both state one. A
rolling upgrade of both roles then pairs old with old and new with new and keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbridge_agent.resources import ConditionStatus as CS
from kvbridge_agent.resources import ConditionType as CT
from kvbridge_agent.resources import RevisionReason, revision_label, same_model

from .config import DECODE, PREFILL
from .model import DesiredCondition, Pair
from .spec import Endpoint

#: The KVEndpoint paths the identity rule names (status.incompatible[].field).
FINGERPRINT_FIELD, REVISION_FIELD = "spec.model.fingerprint", "spec.model.revision"
#: The rules an identity mismatch is filed under (status.incompatible[].rule).
FINGERPRINT_RULE, REVISION_RULE = "model_fingerprint", "model_revision"
#: status.revisions maxItems (the CRD's).
MAX_REVISIONS_LISTED = 32


@dataclass(frozen=True)
class Identity:
    """What an engine serves, as its first rank publishes it."""

    fingerprint: str = ""
    revision: str = ""
    model: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """What separates engine classes (the served name does not decide pairing)."""
        return (self.fingerprint, self.revision)

    @property
    def label(self) -> str:
        return revision_label(self.revision, self.fingerprint)


def identity_of(e: Endpoint) -> Identity:
    return Identity(e.model_fingerprint, e.model_revision, e.model_name)


@dataclass(frozen=True)
class IdentityMismatch:
    rule: str
    field: str
    text: str


def identity_mismatch(decode: Identity, prefill: Identity) -> IdentityMismatch | None:
    """None when the two serve the same weights (module docstring); else the field that
    differs, with both values."""
    if same_model(decode.fingerprint, decode.revision, prefill.fingerprint, prefill.revision):
        return None
    for rule, field, d, p in (
        (FINGERPRINT_RULE, FINGERPRINT_FIELD, decode.fingerprint, prefill.fingerprint),
        (REVISION_RULE, REVISION_FIELD, decode.revision, prefill.revision),
    ):
        if d != p:
            return IdentityMismatch(rule, field, (
                f"decode has {field} {d or '(none)'!r}, prefill has {p or '(none)'!r}: they "
                "load different weights and pair only within one model identity"))
    raise AssertionError("same_model said different models but no field differs")


@dataclass(frozen=True)
class RevisionCount:
    """One ``status.revisions`` item."""

    identity: Identity
    prefills: int
    decodes: int
    pairs: int

    def to_dict(self) -> dict[str, object]:
        i = self.identity
        return {"model": i.model, "revision": i.revision, "fingerprint": i.fingerprint,
                "prefills": self.prefills, "decodes": self.decodes, "pairs": self.pairs}


def revision_counts(engines: Iterable[tuple[str, str, Identity]], pairs: Sequence[Pair]
                    ) -> tuple[RevisionCount, ...]:  # fmt: skip
    """Engines per identity and role, and the pairs that have an engine of it, from
    ``(role, engine id, identity)`` of every complete engine; sorted by label."""
    ids: dict[tuple[str, str], Identity] = {}
    role_of: dict[str, tuple[str, str]] = {}
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for role, engine_id, identity in engines:
        ids.setdefault(identity.key, identity)
        role_of[engine_id] = identity.key
        c = counts.setdefault(identity.key, {PREFILL: 0, DECODE: 0, "pairs": 0})
        c[role] += 1
    for p in pairs:
        for key in {role_of.get(p.decode_engine), role_of.get(p.prefill_engine)} - {None}:
            counts[key]["pairs"] += 1  # type: ignore[index]
    out = [RevisionCount(ids[k], c[PREFILL], c[DECODE], c["pairs"]) for k, c in counts.items()]
    return tuple(sorted(out, key=lambda r: (r.identity.label, r.identity.key)))


def revisions_condition(revisions: Sequence[RevisionCount]) -> DesiredCondition:
    """``RevisionsMatched``: False while an identity has engines of one role and no engine of
    the other role it could pair with, though the KVTransfer has such engines (a rollout that
    upgraded one Deployment only); Unknown while a role has no engine at all."""
    prefills = sum(r.prefills for r in revisions)
    decodes = sum(r.decodes for r in revisions)
    if not prefills or not decodes:
        return DesiredCondition(CT.REVISIONS_MATCHED, CS.UNKNOWN, RevisionReason.WAITING,
                                f"{prefills} prefill and {decodes} decode engine(s): need "
                                "both roles to compare revisions")  # fmt: skip

    def peers(r: RevisionCount, role: str) -> int:
        return sum(o.prefills if role == PREFILL else o.decodes for o in revisions
                   if identity_mismatch(r.identity, o.identity) is None)  # fmt: skip

    for r in revisions:
        for lacking, have, reason in ((PREFILL, r.decodes, RevisionReason.WITHOUT_PREFILL),
                                      (DECODE, r.prefills, RevisionReason.WITHOUT_DECODE)):
            if have and not peers(r, lacking):
                others = ", ".join(_describe(o) for o in revisions if o is not r)
                return DesiredCondition(
                    CT.REVISIONS_MATCHED, CS.FALSE, reason,
                    f"revision {r.identity.label} ({_describe(r)}) has no {lacking} engine of "
                    f"its model; its engines stay unpaired. Other revisions: {others}")
    shown = ", ".join(_describe(r) for r in revisions[:5])
    more = f" and {len(revisions) - 5} more" if len(revisions) > 5 else ""
    return DesiredCondition(CT.REVISIONS_MATCHED, CS.TRUE, RevisionReason.ALL_PAIRED,
                            f"{len(revisions)} revision(s), each with both roles: "
                            f"{shown}{more}")  # fmt: skip


def _describe(r: RevisionCount) -> str:
    return (f"{r.identity.label}: {r.prefills} prefill / {r.decodes} decode engine(s), "
            f"{r.pairs} pair(s)")
