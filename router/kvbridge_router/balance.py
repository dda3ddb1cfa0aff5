"""Choosing a pair, the one place that decides "which pair" for every front (the router, the
endpoint picker, the decode sidecar): the decode engine with the fewest outstanding requests,
then the one of its verified prefills with the fewest. Pure; the callers own the counts'
updates and the table.

Ties go round-robin (by a rotating offset), so idle engines share the first requests
instead of the alphabetically first one taking them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from .table import Engine, RoutingTable


@dataclass(frozen=True)
class Pair:
    decode: Engine
    prefill: Engine

    @property
    def label(self) -> str:
        return f"{self.prefill.engine_id}->{self.decode.engine_id}"


@dataclass
class Balancer:
    """Outstanding requests per engine id, and the choice of the next pair."""

    outstanding: Counter[str] = field(default_factory=Counter)
    _turn: int = 0

    def pick(self, table: RoutingTable, avoid: Collection[tuple[str, str]] = (),
             decodes: Collection[str] | None = None) -> Pair | None:
        """The least-loaded decode with a verified prefill not in ``avoid`` ((decode id,
        prefill id) pairs that already failed this request), then its least-loaded prefill;
        None when no pair is left. ``decodes`` (engine ids) narrows the decodes to choose
        from: the gateway's subset hint, or the sidecar's own engine."""
        self._turn += 1
        candidates = [d for d in table.decodes()
                      if decodes is None or d.engine_id in decodes]  # fmt: skip
        order = sorted(range(len(candidates)), key=lambda i: (
            self.outstanding[candidates[i].engine_id], (i - self._turn) % len(candidates)))
        for i in order:
            decode = candidates[i]
            prefills = [p for p in table.prefills_of(decode.engine_id)
                        if (decode.engine_id, p.engine_id) not in avoid]  # fmt: skip
            if prefills:
                best = min(range(len(prefills)), key=lambda j: (
                    self.outstanding[prefills[j].engine_id], (j - self._turn) % len(prefills)))
                return Pair(decode, prefills[best])
        return None

    def start(self, engine: Engine) -> None:
        self.outstanding[engine.engine_id] += 1

    def done(self, engine: Engine) -> None:
        self.outstanding[engine.engine_id] -= 1
        if self.outstanding[engine.engine_id] <= 0:
            del self.outstanding[engine.engine_id]
