"""Admission checks the CRD schema cannot express (Kubernetes 1.20 has no CEL). Pure.

Each check returns messages that start with the field path, say what was expected and what
was found. The rules the agent applies too (protocol version, TP rank, strides, region names,
memory types per mode) come from :mod:`kvbridge_agent.rules`, named in KVEndpoint paths.
Prefill-against-decode compatibility is not checked here: it needs both objects and belongs
to the planner, which runs the agent's own ``validate_remote``.

KVEndpoint: protocol version, TP rank below TP size, unique region names, block stride at
least block length, memory types valid for the role and mode (push rejects mixed memory,
a pull producer must be single-type, mixed memory needs MLA), a side-channel host that is an
IP or a DNS name without a port, immutable identity fields and a non-decreasing epoch on
update.

KVTransfer: protocol version, TP sizes that divide one another, a decode rank's peers
that fit ``status.peers`` (prefillPerDecode times the prefill ranks per decode rank), the
topology key of the TopologyAware policy, the label keys of both selectors (Kubernetes'
syntax), compatible expected block sizes and region counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge_agent import rules
from kvbridge_agent.resources import (
    ENDPOINT_FIELDS,
    ROLE_SPEC_FIELDS,
    ROLES,
    SPEC,
    TOPOLOGY_AWARE,
)

from . import syntax
from .config import MAX_PEERS, PREFILL
from .errors import SpecError
from .model import endpoint_field
from .spec import Endpoint, parse_endpoint, parse_transfer

_IMMUTABLE = (ENDPOINT_FIELDS.transfer, ENDPOINT_FIELDS.role, ENDPOINT_FIELDS.engine_id,
              ENDPOINT_FIELDS.pod_name)
IMMUTABLE_ENDPOINT_FIELDS = tuple(f.key for f in _IMMUTABLE)


def _messages(*findings: rules.Finding | None) -> list[str]:
    return [f.message for f in findings if f is not None]


def _protocol(version: int) -> list[str]:
    return _messages(rules.protocol_version(version, name=endpoint_field))


def check_endpoint(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Messages for everything wrong with a KVEndpoint; empty when it is admissible."""
    try:
        e = parse_endpoint(body)
    except SpecError as exc:
        return [str(exc)]
    errors = _protocol(e.protocol_version)
    errors += _messages(rules.tp_rank(e.tp_rank, e.tp_size, name=endpoint_field))
    errors += _references(e)
    errors += _regions(e)
    errors += _memory(e)
    if old:
        errors += _update(e, old)
    return errors


def _references(e: Endpoint) -> list[str]:
    """The side-channel host: an IP or a DNS name, no port (object names are patterns in
    the schema)."""
    want = syntax.host(e.host)
    return [] if want is None else [f"spec.sideChannel.host: expected {want}, got {e.host!r}"]


def _regions(e: Endpoint) -> list[str]:
    regions = e.geometry.regions
    found = rules.check_names((r.name for r in regions), name=endpoint_field)
    found += rules.check_strides((r.block_len for r in regions),
                                 (r.block_stride for r in regions), name=endpoint_field)
    return _messages(*found)


def _memory(e: Endpoint) -> list[str]:
    types = [r.mem_type for r in e.geometry.regions]
    return _messages(
        rules.single_memory(types, mode=e.mode, producer=e.role == PREFILL, name=endpoint_field),
        rules.mixed_needs_mla(types, is_mla=e.geometry.is_mla, name=endpoint_field))


def _update(e: Endpoint, old: Mapping[str, Any]) -> list[str]:
    errors = []
    old_spec = old.get(SPEC) or {}
    new_spec = {f.key: getattr(e, f.attr) for f in _IMMUTABLE}
    for key in IMMUTABLE_ENDPOINT_FIELDS:
        if key in old_spec and old_spec[key] != new_spec[key]:
            errors.append(
                f"spec.{key}: field is immutable (was {old_spec[key]!r}, got {new_spec[key]!r}); "
                "delete the KVEndpoint and create a new one"
            )
    old_epoch = ENDPOINT_FIELDS.epoch.get(old_spec)
    if isinstance(old_epoch, int) and e.epoch < old_epoch:
        errors.append(
            f"spec.epoch: expected a value >= the current epoch {old_epoch}, got {e.epoch}; "
            "epochs only grow (a restarted agent publishes a newer one)"
        )
    return errors


def check_transfer(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Messages for everything wrong with a KVTransfer; empty when it is admissible.

    An update that leaves the spec as it was (kopf adding or removing the finalizer, labels,
    annotations) or of a KVTransfer being deleted is always admitted: a spec admitted once,
    or stored before a rule existed, must never keep the finalizer from being removed.
    Every spec field may change otherwise; the operator re-plans.
    """
    if old and ((body.get("metadata") or {}).get("deletionTimestamp")
                or body.get(SPEC) == old.get(SPEC)):
        return []
    try:
        t = parse_transfer(body)
    except SpecError as exc:
        return [str(exc)]
    errors = _protocol(t.protocol_version)
    divide = rules.sizes_divide(
        "tp", t.decode.tp_size, t.prefill.tp_size, field="spec.decode.tensorParallelSize",
        other_field="spec.prefill.tensorParallelSize")
    errors += _messages(divide)
    if divide is None:
        errors += _decode_peers(t.prefill.tp_size, t.decode.tp_size, t.prefill_per_decode)
    if t.policy == TOPOLOGY_AWARE and not t.topology_key:
        errors.append(
            "spec.pairing.topologyKey: required by policy TopologyAware (a node label key, "
            "e.g. topology.kubernetes.io/zone), got nothing"
        )
    elif t.topology_key and t.policy != TOPOLOGY_AWARE:
        errors.append(
            f"spec.pairing.topologyKey: only used by policy TopologyAware, got it with "
            f"policy {t.policy}; remove it or set spec.pairing.policy: TopologyAware"
        )
    if t.topology_key and (want := syntax.label_key(t.topology_key)) is not None:
        errors.append(f"spec.pairing.topologyKey: expected {want}, got {t.topology_key!r}")
    spec = body.get(SPEC) or {}
    for role in ROLES:
        raw = ROLE_SPEC_FIELDS.selector.get(spec.get(role))
        if isinstance(raw, Mapping):
            errors += _selector(raw, f"spec.{role}.selector")
    pe, de = t.prefill.expected, t.decode.expected
    if pe and de and pe.block_size and de.block_size and de.block_size % pe.block_size:
        errors.append(
            f"spec.decode.expectedGeometry.blockSize: expected a multiple of "
            f"spec.prefill.expectedGeometry.blockSize ({pe.block_size}), got {de.block_size} "
            "(decode blocks must split into whole prefill blocks)"
        )
    if pe and de and pe.num_regions and de.num_regions and pe.num_regions != de.num_regions:
        errors.append(
            f"spec.decode.expectedGeometry.numRegions: expected "
            f"spec.prefill.expectedGeometry.numRegions ({pe.num_regions}), got {de.num_regions}"
        )
    return errors


def _decode_peers(prefill_tp: int, decode_tp: int, per_decode: int) -> list[str]:
    """A decode rank's peers (prefillPerDecode engines, each with prefill TP / decode TP
    ranks to read from when that is above 1) must fit ``status.peers``."""
    ranks = max(1, prefill_tp // decode_tp)
    if ranks > MAX_PEERS:
        return [
            f"spec.prefill.tensorParallelSize: expected at most {MAX_PEERS} times "
            f"spec.decode.tensorParallelSize ({decode_tp}), got {prefill_tp}; a decode rank "
            f"reads from {ranks} prefill ranks and status.peers lists at most {MAX_PEERS}"
        ]
    if per_decode * ranks > MAX_PEERS:
        return [
            f"spec.pairing.prefillPerDecode: expected at most {MAX_PEERS // ranks} with "
            f"{ranks} prefill rank(s) per decode rank, got {per_decode}; a decode rank's "
            f"peers (prefillPerDecode x {ranks}) must fit status.peers (at most {MAX_PEERS})"
        ]
    return []


def _selector(raw: Mapping[str, Any], path: str) -> list[str]:
    """The label keys of a selector in Kubernetes' syntax: a key no label can have would
    silently exclude every endpoint. (Label values are patterns in the schema; a map's keys
    cannot be, on Kubernetes 1.20.)"""
    keys = [(f"{path}.matchLabels[{key!r}]", str(key)) for key in raw.get("matchLabels") or {}]
    keys += [(f"{path}.matchExpressions[{i}].key", str((expr or {}).get("key", "")))
             for i, expr in enumerate(raw.get("matchExpressions") or ())]
    return [f"{where}: expected {want}, got {key!r}"
            for where, key in keys if (want := syntax.label_key(key)) is not None]
