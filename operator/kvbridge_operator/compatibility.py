"""Planning step 2: which decode engines can read from which prefill engines. Pure.

Every decode rank is checked against the prefill ranks it handshakes with (spec §1.9 rank
mapping) through the agent's own :func:`kvbridge_agent.protocol.validate_remote`, memoised
on geometry classes, so thousands of identical engines cost one check. Engines compatible
with no engine of the other role get an Incompatible verdict naming the rule and field. The
model identity (:mod:`.revisions`) is checked first: engines of other weights never pair.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvbridge_agent.geometry import GeometryError, handshake_target_ranks
from kvbridge_agent.protocol import EngineGeometry, ValidationOptions, Verdict, validate_remote

from .config import DECODE, PREFILL
from .eligibility import Engine, Verdicts
from .model import EndpointState, endpoint_field
from .revisions import identity_mismatch
from .spec import Transfer

EngineKey = tuple[tuple[str, str], tuple[EngineGeometry, ...]]


@dataclass(frozen=True)
class Mismatch:
    """The first rule a decode engine breaks against a prefill engine, and where."""

    decode_rank: int
    prefill_rank: int
    rule: str
    field: str  # KVEndpoint path, e.g. spec.geometry.regions[3].blockLen
    text: str


@dataclass(frozen=True)
class Candidates:
    """The compatible prefill engines of one decode geometry class (shared by its engines)."""

    index: int
    ids: list[str]
    members: frozenset[str]


@dataclass(frozen=True)
class Classified:
    """Decode engines with their candidates, prefill engines worth pairing, and how many
    decode×prefill engine pairs were incompatible."""

    decode: dict[str, tuple[Engine, Candidates]]
    prefill: dict[str, Engine]
    incompatible_pairs: int


class Compatibility:
    """Decode-engine class vs prefill-engine class verdicts, memoised per rank geometry."""

    def __init__(self, transfer: Transfer) -> None:
        self.mode = transfer.mode
        self.p_tp = transfer.prefill.tp_size
        self.options = ValidationOptions(enforce_handshake_compat=transfer.enforce_hash)
        self._ranks: dict[tuple[EngineGeometry, EngineGeometry], Verdict] = {}
        self._engines: dict[tuple[EngineKey, EngineKey], Mismatch | None] = {}

    def check(self, d: Engine, p: Engine) -> Mismatch | None:
        """None when decode engine ``d`` can read from prefill engine ``p``."""
        key = (d.key, p.key)
        if key not in self._engines:
            self._engines[key] = self._check(d, p)
        return self._engines[key]

    def _check(self, d: Engine, p: Engine) -> Mismatch | None:
        other_model = identity_mismatch(d.identity, p.identity)
        if other_model is not None:  # checked first: other weights pair with nothing
            return Mismatch(0, 0, other_model.rule, other_model.field, other_model.text)
        p_geometry = p.geometry
        for r, dg in enumerate(d.geometry):
            try:
                targets = handshake_target_ranks(r, d.tp_size, p.tp_size)
            except GeometryError as exc:
                return Mismatch(r, 0, "tp_size", "spec.tpSize", str(exc))
            for t in targets:
                pair = (dg, p_geometry[t])
                if pair not in self._ranks:
                    self._ranks[pair] = validate_remote(
                        dg, p_geometry[t], mode=self.mode, expected_tp_size=self.p_tp,
                        options=self.options,
                    )  # fmt: skip
                verdict = self._ranks[pair]
                if not verdict.ok:
                    problem = verdict.problems[0]
                    return Mismatch(r, t, str(problem.rule), endpoint_field(problem.field),
                                    problem.message)  # fmt: skip
        return None


def classify(engines: dict[str, dict[str, Engine]], transfer: Transfer, v: Verdicts
             ) -> Classified:  # fmt: skip
    """Compatible prefill engines per decode engine; verdicts for engines that fit none."""
    compat = Compatibility(transfer)
    d_classes: dict[EngineKey, list[Engine]] = defaultdict(list)
    p_classes: dict[EngineKey, list[Engine]] = defaultdict(list)
    for d in engines[DECODE].values():
        d_classes[d.key].append(d)
    for p in engines[PREFILL].values():
        p_classes[p.key].append(p)
    ok_for_d: dict[EngineKey, list[EngineKey]] = defaultdict(list)
    used_p: set[EngineKey] = set()
    incompatible_pairs = 0
    d_first: dict[EngineKey, tuple[Engine, Mismatch]] = {}  # decode class -> (prefill, why)
    p_first: dict[EngineKey, tuple[Engine, Mismatch]] = {}  # prefill class -> (decode, why)
    for dk, ds in d_classes.items():
        for pk, ps in sorted(p_classes.items(), key=lambda kv: kv[1][0].engine_id):
            mismatch = compat.check(ds[0], ps[0])
            if mismatch is None:
                ok_for_d[dk].append(pk)
                used_p.add(pk)
            else:
                incompatible_pairs += len(ds) * len(ps)
                d_first.setdefault(dk, (ps[0], mismatch))
                p_first.setdefault(pk, (ds[0], mismatch))
    usable_d: dict[str, tuple[Engine, Candidates]] = {}
    for index, (dk, ds) in enumerate(d_classes.items()):
        if ok_for_d.get(dk):
            ids = sorted(p.engine_id for pk in ok_for_d[dk] for p in p_classes[pk])
            group = Candidates(index, ids, frozenset(ids))
            for d in ds:
                usable_d[d.engine_id] = (d, group)
        elif dk in d_first:
            p, mismatch = d_first[dk]
            for d in ds:
                _report(v, d, decode=d, prefill=p, mismatch=mismatch,
                        n_other=len(engines[PREFILL]))  # fmt: skip
    if not p_classes:
        for d in engines[DECODE].values():
            for e in d.ranks:
                v.set(e, EndpointState.UNPAIRED, "NoPrefillEngines",
                      "no complete, compatible prefill engine is available yet")  # fmt: skip
    usable_p: dict[str, Engine] = {}
    for pk, ps in p_classes.items():
        if pk in used_p or not d_classes:
            usable_p.update({p.engine_id: p for p in ps})
        elif usable_d:  # other prefill engines serve the decodes: this one is the odd one
            d, mismatch = p_first[pk]
            for p in ps:
                _report(v, p, decode=d, prefill=p, mismatch=mismatch,
                        n_other=len(engines[DECODE]))  # fmt: skip
        else:  # nothing pairs at all; the decode endpoints carry the reason
            for p in ps:
                for e in p.ranks:
                    v.set(e, EndpointState.UNPAIRED, "NoCompatibleDecode",
                          "no decode engine is compatible with this prefill engine; see the "
                          "decode KVEndpoints' status for the rule")  # fmt: skip
    return Classified(dict(sorted(usable_d.items())), usable_p, incompatible_pairs)


def _report(v: Verdicts, engine: Engine, *, decode: Engine, prefill: Engine,
            mismatch: Mismatch, n_other: int) -> None:  # fmt: skip
    """Verdicts for ``engine`` (one of ``decode``/``prefill``), compatible with none of the
    ``n_other`` engines of the other role: the offending rank names the rule and field, its
    other ranks point at it."""
    own, other_rank = (
        (mismatch.decode_rank, mismatch.prefill_rank) if engine is decode
        else (mismatch.prefill_rank, mismatch.decode_rank)
    )  # fmt: skip
    other = prefill if engine is decode else decode
    culprit, versus = engine.ranks[own], other.ranks[other_rank]
    noun = "decode" if engine.role == PREFILL else "prefill"
    message = (
        f"incompatible with every {noun} engine ({n_other}); decode "
        f"{decode.ranks[mismatch.decode_rank].name} vs prefill "
        f"{prefill.ranks[mismatch.prefill_rank].name}: {mismatch.text}"
    )
    for e in engine.ranks:
        if e is culprit:
            v.incompatible(e, mismatch.rule, mismatch.field, message)
        else:
            v.set(e, EndpointState.INCOMPATIBLE, "EngineIncompatible",
                  f"rank {culprit.tp_rank} of engine {engine.engine_id} ({culprit.name}) is "
                  f"incompatible with every {noun} engine; vs {versus.name}")  # fmt: skip
