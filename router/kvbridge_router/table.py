"""Which (decode, prefill) engine pairs may carry a request: pure, from the KVTransfer and
its KVEndpoints as the API server stores them.

A pair is *verified* while the operator pairs it and the decode has proven it: every rank of
the decode engine is ``Paired``, lists ranks of the prefill engine among its peers, and
reports a ``Succeeded`` handshake with each of them at the epoch that prefill rank publishes
now; every rank of the prefill engine is ``Paired`` too. A restarted prefill (new epoch), a
failed or missing handshake, an endpoint the operator refused, unpaired or marked stale, and an
endpoint that is gone or terminating (its pod deleted) all take the pair out. Engines are
grouped by ``spec.engineId``: with tensor parallelism each rank publishes an endpoint, and the
engine serves HTTP on its pod's address.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PAIRED = "Paired"
SUCCEEDED = "Succeeded"


@dataclass(frozen=True)
class Engine:
    """One vLLM engine: its id, its pod(s) and the address its OpenAI server listens on."""

    engine_id: str
    role: str
    host: str
    pods: tuple[str, ...]
    #: its OpenAI port (``spec.servingPort``); 0: the router's --engine-port
    port: int = 0
    #: tokens per logical KV block, what vLLM hashes for its prefix cache (the kernel
    #: block size times the kernel blocks per logical block); 0: not stated
    block_size: int = 0
    #: KV bytes of one block over all ranks and regions (what a decode pulls per block)
    block_bytes: int = 0
    #: logical KV blocks the engine holds (its first rank's ``spec.geometry.numBlocks``,
    #: kernel blocks, over the kernel blocks per logical block)
    num_blocks: int = 0
    #: the port of its KV-event publisher (``spec.kvEventsPort``); 0: none stated
    kv_events_port: int = 0


@dataclass(frozen=True)
class RoutingTable:
    """Verified prefills per decode engine; ``reason`` says why there are none."""

    pairs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    engines: Mapping[str, Engine] = field(default_factory=dict)
    reason: str = ""
    #: the UCX transport(s) each verified (decode, prefill) pair's handshakes report
    transports: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def decodes(self) -> list[Engine]:
        return [self.engines[d] for d in self.pairs]

    def prefills_of(self, decode_id: str) -> list[Engine]:
        return [self.engines[p] for p in self.pairs.get(decode_id, ())]

    def pair_count(self) -> int:
        return sum(len(p) for p in self.pairs.values())

    def transport(self, decode_id: str, prefill_id: str) -> str:
        return self.transports.get((decode_id, prefill_id), "")


def _live(doc: Mapping[str, Any], transfer: str) -> bool:
    meta, spec = doc.get("metadata") or {}, doc.get("spec") or {}
    return spec.get("transferName") == transfer and not meta.get("deletionTimestamp")


def routing_table(transfer_name: str, transfer: Mapping[str, Any] | None,
                  endpoints: Iterable[Mapping[str, Any]]) -> RoutingTable:  # fmt: skip
    """The verified pairs of KVTransfer ``transfer_name`` (``transfer`` is its stored object,
    None when it does not exist) among ``endpoints`` (KVEndpoints of its namespace)."""
    if transfer is None or (transfer.get("metadata") or {}).get("deletionTimestamp"):
        return RoutingTable(reason=f"KVTransfer {transfer_name} does not exist")
    docs = [e for e in endpoints if _live(e, transfer_name)]
    by_name = {e["metadata"]["name"]: e for e in docs}
    ranks: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for e in docs:
        ranks[e["spec"]["engineId"]].append(e)
    engines = {eid: _engine(eid, rs) for eid, rs in ranks.items()}

    def all_paired(eid: str) -> bool:
        return all((r.get("status") or {}).get("state") == PAIRED for r in ranks[eid])

    pairs: dict[str, tuple[str, ...]] = {}
    for eid, engine in sorted(engines.items()):
        if engine.role != "decode" or not all_paired(eid):
            continue
        verified = _verified_prefills(ranks[eid], by_name)
        ok = tuple(sorted(p for p in verified
                          if engines[p].role == "prefill" and all_paired(p)))  # fmt: skip
        if ok:
            pairs[eid] = ok
    if pairs:
        return RoutingTable(pairs, engines, transports=_transports(pairs, ranks, by_name))
    return RoutingTable({}, engines, _why_none(transfer_name, engines, ranks))


def _engine(engine_id: str, ranks: list[Mapping[str, Any]]) -> Engine:
    first = min(ranks, key=lambda r: r["spec"].get("tpRank", 0))
    spec = first["spec"]
    geometry = spec.get("geometry") or {}
    return Engine(engine_id, spec["role"], spec["sideChannel"]["host"],
                  tuple(sorted(r["spec"].get("podName", r["metadata"]["name"]) for r in ranks)),
                  int(spec.get("servingPort") or 0),
                  int(geometry.get("blockSize") or 0)
                  * int(geometry.get("physicalBlocksPerLogical") or 1),
                  sum(_block_bytes(r["spec"].get("geometry") or {}) for r in ranks),
                  int(geometry.get("numBlocks") or 0)
                  // int(geometry.get("physicalBlocksPerLogical") or 1),
                  int(spec.get("kvEventsPort") or 0))  # fmt: skip


def _block_bytes(geometry: Mapping[str, Any]) -> int:
    """One logical block's bytes on one rank: every region's block, times the kernel blocks
    per logical block."""
    per_kernel_block = sum(int(r.get("blockLen") or 0) for r in geometry.get("regions") or [])
    return per_kernel_block * int(geometry.get("physicalBlocksPerLogical") or 1)


def _transports(pairs: Mapping[str, tuple[str, ...]],
                ranks: Mapping[str, list[Mapping[str, Any]]],
                by_name: Mapping[str, Mapping[str, Any]]
                ) -> dict[tuple[str, str], str]:  # fmt: skip
    """The transport the decode's ranks report for each verified prefill (their handshakes
    with its ranks; several values joined with ``+``, sorted)."""
    out: dict[tuple[str, str], str] = {}
    for decode, prefills in pairs.items():
        seen: dict[str, set[str]] = defaultdict(set)
        for rank in ranks[decode]:
            for shake in (rank.get("status") or {}).get("handshakes") or []:
                peer = by_name.get(shake.get("peer", ""))
                if peer is not None and shake.get("transport"):
                    seen[peer["spec"]["engineId"]].add(shake["transport"])
        for prefill in prefills:
            if seen.get(prefill):
                out[(decode, prefill)] = "+".join(sorted(seen[prefill]))
    return out


def _verified_prefills(decode_ranks: list[Mapping[str, Any]],
                       by_name: Mapping[str, Mapping[str, Any]]) -> set[str]:  # fmt: skip
    """Prefill engines every decode rank has proven at their current epochs."""
    result: set[str] | None = None
    for rank in decode_ranks:
        status = rank.get("status") or {}
        shakes = {(h.get("peer"), h.get("epoch")): h.get("state")
                  for h in status.get("handshakes") or []}  # fmt: skip
        good: set[str] = set()
        bad: set[str] = set()
        for peer in status.get("peers") or []:
            target = by_name.get(peer.get("name", ""))
            if target is None:
                continue
            engine = target["spec"]["engineId"]
            epoch = target["spec"].get("epoch")
            proven = peer.get("epoch") == epoch and shakes.get((peer["name"], epoch)) == SUCCEEDED
            (good if proven else bad).add(engine)
        good -= bad
        result = good if result is None else result & good
    return result or set()


def _why_none(transfer: str, engines: Mapping[str, Engine],
              ranks: Mapping[str, list[Mapping[str, Any]]]) -> str:  # fmt: skip
    decodes = [e for e in engines.values() if e.role == "decode"]
    if not decodes:
        return f"no decode KVEndpoint of KVTransfer {transfer}"
    if not any(e.role == "prefill" for e in engines.values()):
        return f"no prefill KVEndpoint of KVTransfer {transfer}"
    states = sorted({(r.get("status") or {}).get("state") or "Pending"
                     for d in decodes for r in ranks[d.engine_id]})  # fmt: skip
    if PAIRED not in states:
        return (f"no decode engine of KVTransfer {transfer} is paired (decode endpoints are "
                f"{', '.join(states)})")
    return (f"no pair of KVTransfer {transfer} is verified: no paired decode reports a "
            "succeeded handshake with its prefill at the prefill's current epoch")
