"""Which (decode, prefill) engine pairs may carry a request: pure, from the KVTransfer and
its KVEndpoints as the API server stores them.

A pair is *verified* while the operator pairs it and the decode has proven it: every rank of
the decode engine is ``Paired``, lists ranks of the prefill engine among its peers, and
reports a ``Succeeded`` handshake with each of them at the epoch that prefill rank publishes
now; every rank of the prefill engine is ``Paired`` too. A restarted prefill (new epoch), a
failed or missing handshake, an endpoint the operator refused, unpaired or marked stale, and an
endpoint that is gone or terminating (its pod deleted) all take the pair out, and so do two
engines of different model weights (``spec.model``), whatever the statuses say. A verified
pair is *held back* while a pod of either engine is not Ready or is terminating (pod_state.py):
it takes no new request until both pods are Ready again, or for good once one is deleted.
Engines are grouped by ``spec.engineId``: with tensor parallelism each rank publishes an
endpoint, and the engine serves HTTP on its pod's address. Every key and state is read
through the agent's field tables (``kvbridge_agent.resources``), which the CRD test holds to
the schema.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.resources import (
    DECODE,
    ENDPOINT_FIELDS,
    ENDPOINT_STATUS_FIELDS,
    GEOMETRY,
    GEOMETRY_FIELDS,
    HANDSHAKE_FIELDS,
    PEER_FIELDS,
    PREFILL,
    REGION_FIELDS,
    REGIONS,
    SPEC,
    STATUS,
    EndpointState,
    HandshakeState,
    revision_label,
    same_model,
)

from .pod_state import PodState, unusable_pods

log = logging.getLogger(__name__)

PAIRED = EndpointState.PAIRED
SUCCEEDED = HandshakeState.SUCCEEDED
_S, _G, _R = ENDPOINT_FIELDS, GEOMETRY_FIELDS, REGION_FIELDS
_ST, _P, _H = ENDPOINT_STATUS_FIELDS, PEER_FIELDS, HANDSHAKE_FIELDS


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
    #: what it serves (``spec.model``; empty on agents that publish none)
    model_fingerprint: str = ""
    model_revision: str = ""

    @property
    def revision(self) -> str:
        """The revision label metrics and the ``x-kvbridge-revision`` header carry."""
        return revision_label(self.model_revision, self.model_fingerprint)

    def same_model(self, other: Engine) -> bool:
        return same_model(self.model_fingerprint, self.model_revision,
                          other.model_fingerprint, other.model_revision)  # fmt: skip


@dataclass(frozen=True)
class RoutingTable:
    """Verified prefills per decode engine; ``reason`` says why there are none."""

    pairs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    engines: Mapping[str, Engine] = field(default_factory=dict)
    reason: str = ""
    #: the UCX transport(s) each verified (decode, prefill) pair's handshakes report
    transports: Mapping[tuple[str, str], str] = field(default_factory=dict)
    #: engines of verified pairs held back, with why (a pod not Ready or terminating)
    held: Mapping[str, str] = field(default_factory=dict)

    def decodes(self) -> list[Engine]:
        return [self.engines[d] for d in self.pairs]

    def prefills_of(self, decode_id: str) -> list[Engine]:
        return [self.engines[p] for p in self.pairs.get(decode_id, ())]

    def pair_count(self) -> int:
        return sum(len(p) for p in self.pairs.values())

    def transport(self, decode_id: str, prefill_id: str) -> str:
        return self.transports.get((decode_id, prefill_id), "")


def _live(doc: Mapping[str, Any], transfer: str) -> bool:
    meta, spec = doc.get("metadata") or {}, doc.get(SPEC) or {}
    return _S.transfer.get(spec) == transfer and not meta.get("deletionTimestamp")


def routing_table(transfer_name: str, transfer: Mapping[str, Any] | None,
                  endpoints: Iterable[Mapping[str, Any]],
                  pods: Mapping[str, PodState] | None = None) -> RoutingTable:  # fmt: skip
    """The verified pairs of KVTransfer ``transfer_name`` (``transfer`` is its stored object,
    None when it does not exist) among ``endpoints`` (KVEndpoints of its namespace), less
    those with a pod in ``pods`` (the namespace's pods by name) that takes no request now;
    ``pods`` None: the router cannot read pods, the endpoints alone decide."""
    if transfer is None or (transfer.get("metadata") or {}).get("deletionTimestamp"):
        return RoutingTable(reason=f"KVTransfer {transfer_name} does not exist")
    docs = [e for e in endpoints if _live(e, transfer_name)]
    by_name = {e["metadata"]["name"]: e for e in docs}
    ranks: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for e in docs:
        ranks[_S.engine_id.at(e[SPEC])].append(e)
    engines = {eid: _engine(eid, rs) for eid, rs in ranks.items()}

    def all_paired(eid: str) -> bool:
        return all(_ST.state.get(r.get(STATUS)) == PAIRED for r in ranks[eid])

    pairs: dict[str, tuple[str, ...]] = {}
    for eid, engine in sorted(engines.items()):
        if engine.role != DECODE or not all_paired(eid):
            continue
        verified = _verified_prefills(ranks[eid], by_name)
        ok = tuple(sorted(p for p in verified if engines[p].role == PREFILL and all_paired(p)
                          and _same_model(engine, engines[p])))  # fmt: skip
        if ok:
            pairs[eid] = ok
    pairs, held = _hold_back(pairs, engines, pods)
    if pairs:
        return RoutingTable(pairs, engines, transports=_transports(pairs, ranks, by_name),
                            held=held)
    if held:
        return RoutingTable({}, engines, held=held, reason=(
            f"every verified pair of KVTransfer {transfer_name} has a pod that takes no "
            f"request now: {'; '.join(f'{e}: {why}' for e, why in sorted(held.items()))}"))
    return RoutingTable({}, engines, _why_none(transfer_name, engines, ranks))


def _hold_back(pairs: Mapping[str, tuple[str, ...]], engines: Mapping[str, Engine],
               pods: Mapping[str, PodState] | None
               ) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:  # fmt: skip
    """``pairs`` less those with an engine whose pod is not Ready or is terminating, and
    those engines with why."""
    in_pairs = set(pairs) | {p for ps in pairs.values() for p in ps}
    held: dict[str, str] = {}
    for eid in sorted(in_pairs):
        bad = unusable_pods(engines[eid].pods, pods)
        if bad:
            held[eid] = ", ".join(f"pod {pod} {why}" for pod, why in sorted(bad.items()))
    kept = {d: tuple(p for p in ps if p not in held) for d, ps in pairs.items() if d not in held}
    return {d: ps for d, ps in kept.items() if ps}, held


def _engine(engine_id: str, ranks: list[Mapping[str, Any]]) -> Engine:
    first = min(ranks, key=lambda r: r[SPEC].get(_S.tp_rank.key, 0))
    spec = first[SPEC]
    geometry = spec.get(GEOMETRY) or {}
    per_logical = int(_G.physical_blocks_per_logical.get(geometry) or 1)
    return Engine(engine_id, _S.role.at(spec), _S.host.at(spec),
                  tuple(sorted(r[SPEC].get(_S.pod_name.key, r["metadata"]["name"])
                               for r in ranks)),
                  int(_S.serving_port.get(spec) or 0),
                  int(_G.block_size.get(geometry) or 0) * per_logical,
                  sum(_block_bytes(r[SPEC].get(GEOMETRY) or {}) for r in ranks),
                  int(_G.num_blocks.get(geometry) or 0) // per_logical,
                  int(_S.kv_events_port.get(spec) or 0),
                  _S.model_fingerprint.get(spec) or "", _S.model_revision.get(spec) or "")


def _same_model(decode: Engine, prefill: Engine) -> bool:
    """Defence in depth: a pair over two models' weights answers wrong tokens, so it is
    skipped even when the statuses say it is paired (the operator never pairs one)."""
    if decode.same_model(prefill):
        return True
    log.debug("skipping pair %s->%s: different models (fingerprint %r revision %r vs "
              "fingerprint %r revision %r)", prefill.engine_id, decode.engine_id,
              prefill.model_fingerprint, prefill.model_revision, decode.model_fingerprint,
              decode.model_revision)
    return False


def _block_bytes(geometry: Mapping[str, Any]) -> int:
    """One logical block's bytes on one rank: every region's block, times the kernel blocks
    per logical block."""
    per_kernel_block = sum(int(_R.block_len.get(r) or 0) for r in geometry.get(REGIONS) or [])
    return per_kernel_block * int(_G.physical_blocks_per_logical.get(geometry) or 1)


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
            for shake in _ST.handshakes.get(rank.get(STATUS)) or []:
                peer = by_name.get(shake.get(_H.peer.key, ""))
                if peer is not None and _H.transport.get(shake):
                    seen[_S.engine_id.at(peer[SPEC])].add(_H.transport.at(shake))
        for prefill in prefills:
            if seen.get(prefill):
                out[(decode, prefill)] = "+".join(sorted(seen[prefill]))
    return out


def _verified_prefills(decode_ranks: list[Mapping[str, Any]],
                       by_name: Mapping[str, Mapping[str, Any]]) -> set[str]:  # fmt: skip
    """Prefill engines every decode rank has proven at their current epochs."""
    result: set[str] | None = None
    for rank in decode_ranks:
        status = rank.get(STATUS) or {}
        shakes = {(_H.peer.get(h), _H.epoch.get(h)): _H.state.get(h)
                  for h in _ST.handshakes.get(status) or []}  # fmt: skip
        good: set[str] = set()
        bad: set[str] = set()
        for peer in _ST.peers.get(status) or []:
            target = by_name.get(peer.get(_P.name.key, ""))
            if target is None:
                continue
            engine = _S.engine_id.at(target[SPEC])
            epoch = _S.epoch.get(target[SPEC])
            proven = (_P.epoch.get(peer) == epoch
                      and shakes.get((_P.name.at(peer), epoch)) == SUCCEEDED)
            (good if proven else bad).add(engine)
        good -= bad
        result = good if result is None else result & good
    return result or set()


def _why_none(transfer: str, engines: Mapping[str, Engine],
              ranks: Mapping[str, list[Mapping[str, Any]]]) -> str:  # fmt: skip
    decodes = [e for e in engines.values() if e.role == DECODE]
    if not decodes:
        return f"no decode KVEndpoint of KVTransfer {transfer}"
    if not any(e.role == PREFILL for e in engines.values()):
        return f"no prefill KVEndpoint of KVTransfer {transfer}"
    states = sorted({_ST.state.get(r.get(STATUS)) or EndpointState.PENDING.value
                     for d in decodes for r in ranks[d.engine_id]})  # fmt: skip
    if PAIRED not in states:
        return (f"no decode engine of KVTransfer {transfer} is paired (decode endpoints are "
                f"{', '.join(states)})")
    return (f"no pair of KVTransfer {transfer} is verified: no paired decode reports a "
            "succeeded handshake with its prefill at the prefill's current epoch")
