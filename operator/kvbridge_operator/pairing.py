"""Planning step 3: which prefill engines each usable decode engine gets. Pure.

Sticky first: a decode engine keeps the prefill engines it had (read from its endpoints'
status) while they stay compatible, under the balance cap and, for TopologyAware, local
when a local candidate exists. Then least-loaded fill, local candidates first, ties broken
by engine id; with ``topologyScope: Required`` local candidates only. Candidate lists are
per decode class, so the cost stays linear in engines.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvbridge_agent.resources import TOPOLOGY_AWARE

from .compatibility import Candidates
from .eligibility import Engine
from .spec import Transfer


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


def assign(
    transfer: Transfer,
    usable_d: dict[str, tuple[Engine, Candidates]],
    usable_p: dict[str, Engine],
    node_labels: Mapping[str, Mapping[str, str]],
) -> dict[str, list[str]]:
    """Decode engine id -> its assigned prefill engine ids, sorted (module docstring)."""
    topo_key = transfer.topology_key if transfer.policy == TOPOLOGY_AWARE else ""
    required = bool(topo_key) and transfer.topology_required

    def topo(e: Engine) -> str | None:
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
        has_local = bool(local_ids[(g.index, w)]) or required
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
            if required:  # only a local engine, even above the balance cap
                if pick is None:
                    break
            elif pick is None or load[pick] >= cap:
                alt = heaps.best(("any", g.index), g.ids, taken)
                if pick is None or (alt is not None and load[alt] < load[pick]):
                    pick = alt
            if pick is None:
                break
            assigned[d].append(pick)
            load[pick] += 1
    return {d: sorted(ps) for d, ps in assigned.items()}
