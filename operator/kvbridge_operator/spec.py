"""Raw KVTransfer / KVEndpoint dicts -> frozen dataclasses, with field-path errors.

Pure: no kopf, no Kubernetes client. The CRD schema already enforces types and bounds, so a
:class:`~kvbridge_operator.errors.SpecError` here means an object slipped past admission (for
example created while the webhook was down); its message names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvbridge_agent.protocol import EngineGeometry, RegionGeometry
from kvbridge_agent.resources import (
    BALANCED,
    DOES_NOT_EXIST,
    ENDPOINT_FIELDS,
    ENDPOINT_STATUS_FIELDS,
    EXISTS,
    GEOMETRY,
    GEOMETRY_FIELDS,
    HANDSHAKE_FIELDS,
    IN,
    NOT_IN,
    PEER_FIELDS,
    REGION_FIELDS,
    REGIONS,
    REQUIRED,
    REQUIREMENT_FIELDS,
    ROLE_SPEC_FIELDS,
    SPEC,
    STATUS,
    TRANSFER_SPEC_FIELDS,
    EndpointField,
    HandshakeState,
)

from .config import DECODE, PREFILL
from .errors import SpecError

_MISSING = object()
#: spec.transport.accepted items (the CRD's pattern): UCX transport names and families.
_TRANSPORT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def _get(
    d: Mapping[str, Any],
    key: str,
    path: str,
    kind: type | tuple[type, ...],
    default: Any = _MISSING,
) -> Any:
    value = d.get(key, _MISSING) if isinstance(d, Mapping) else _MISSING
    where = f"{path}.{key}" if path else key
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise SpecError(where, "a value (the field is required)", None)
        return default
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SpecError(where, f"type {names}", value)
    return value


def _enum(
    d: Mapping[str, Any], key: str, path: str, allowed: tuple[str, ...], default: Any = _MISSING
) -> str:
    value = _get(d, key, path, str, default)
    if value not in allowed:
        raise SpecError(f"{path}.{key}", f"one of {', '.join(allowed)}", value)
    return value


# -- KVEndpoint --------------------------------------------------------------------------------


#: One region of ``spec.geometry.regions``: the agent's record, so both sides read one type.
Region = RegionGeometry


@dataclass(frozen=True)
class Geometry:
    block_size: int
    physical_blocks_per_logical: int
    num_blocks: int
    kv_cache_layout: str
    attention_backend: str
    is_mla: bool
    num_kv_heads: int | None
    dcp_size: int
    pcp_size: int
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class Handshake:
    """One agent-reported handshake result (``status.handshakes[i]``)."""

    peer: str
    epoch: int
    succeeded: bool
    message: str = ""
    transport: str = ""  # UCX transport(s) the agent saw UCX select; "" when not reported


@dataclass(frozen=True)
class Endpoint:
    """A parsed KVEndpoint; ``status`` is the operator-owned part as last seen."""

    name: str
    namespace: str
    uid: str
    generation: int
    labels: tuple[tuple[str, str], ...]
    deleting: bool
    role: str
    transfer: str
    engine_id: str
    pod_name: str
    node_name: str
    host: str
    port: int
    tp_rank: int
    tp_size: int
    dp_index: int
    protocol_version: int
    compatibility_hash: str | None
    mode: str
    epoch: int
    geometry: Geometry
    pod_uid: str = ""
    serving_port: int = 0
    kv_events_port: int = 0
    model_name: str = ""
    model_revision: str = ""
    model_fingerprint: str = ""
    vllm_version: str = ""
    kvbridge_version: str = ""
    handshakes: tuple[Handshake, ...] = ()
    # Compared (not hashed): kopf's index keeps the stored value when the new one compares
    # equal, so a status-only change (the peers sticky pairing reads, the resourceVersion an
    # orphan write is conditioned on) must make two parses unequal to reach the index.
    status: Mapping[str, Any] = field(default_factory=dict, hash=False)
    resource_version: str = field(default="", hash=False)

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    @property
    def previous_peer_engines(self) -> tuple[str, ...]:
        """Engine ids of the peers the operator assigned last time (for sticky pairing)."""
        peers = ENDPOINT_STATUS_FIELDS.peers.get(self.status) or ()
        engine_id = PEER_FIELDS.engine_id
        return tuple(sorted({p.get(engine_id.key, "") for p in peers if isinstance(p, Mapping)}))

    @cached_property
    def validation_geometry(self) -> EngineGeometry:
        """The agent's :class:`EngineGeometry` for this rank, keyed for memoisation.

        Engine id and rank are left neutral (they play no part in the rules the planner runs),
        so equal geometries compare and hash equal across engines.
        """
        g = self.geometry
        return EngineGeometry.from_regions(
            g.regions,
            engine_id="",
            tp_size=self.tp_size,
            **{f.wire: getattr(g, f.attr) for f in GEOMETRY_FIELDS},
            protocol_version=self.protocol_version,
            compatibility_hash=self.compatibility_hash,
            transfer_mode=self.mode,
        )


def _field(d: Mapping[str, Any], f: EndpointField, path: str) -> Any:
    """Read one table field of ``d`` (its parents first), checked as the table says."""
    for parent in f.parents:
        if not f.required and d.get(parent) is None:
            return f.default  # an optional object (spec.model) left out: its fields' defaults
        d = _get(d, parent, path, Mapping)
        path = f"{path}.{parent}"
    return _leaf(d, f, path)


def _leaf(d: Mapping[str, Any], f: EndpointField, path: str) -> Any:
    """Read a table field of ``d`` by its own name (``d`` is its parent already)."""
    default = _MISSING if f.required else f.default
    if f.choices:
        return _enum(d, f.name, path, f.choices, default)
    return _get(d, f.name, path, f.kind, default)


def _fields(d: Mapping[str, Any], table: Sequence[EndpointField], path: str) -> dict[str, Any]:
    return {f.attr: _field(d, f, path) for f in table}


#: What the operator reads of a ``status.handshakes`` item, in the order it checks it.
_HANDSHAKE_READ = tuple(getattr(HANDSHAKE_FIELDS, a)
                        for a in ("state", "peer", "epoch", "message", "transport"))


def parse_geometry(raw: Mapping[str, Any], path: str = "spec.geometry") -> Geometry:
    regions_raw = _get(raw, REGIONS, path, list)
    if not regions_raw:
        raise SpecError(f"{path}.{REGIONS}", "at least one region", regions_raw)
    regions = []
    for i, r in enumerate(regions_raw):
        rp = f"{path}.{REGIONS}[{i}]"
        if not isinstance(r, Mapping):
            raise SpecError(rp, "an object", r)
        regions.append(Region(**_fields(r, REGION_FIELDS, rp)))
    return Geometry(**_fields(raw, GEOMETRY_FIELDS, path), regions=tuple(regions))


def parse_endpoint(body: Mapping[str, Any]) -> Endpoint:
    """Parse a KVEndpoint object (dict or kopf body). Raises :class:`SpecError`."""
    meta = body.get("metadata") or {}
    spec = _get(body, SPEC, "", Mapping)
    status = body.get(STATUS) or {}
    _get(spec, ENDPOINT_FIELDS.host.parents[0], SPEC, Mapping)   # named before the status is read
    shakes = ENDPOINT_STATUS_FIELDS.handshakes
    handshakes = []
    for i, h in enumerate(shakes.get(status) or ()):
        hp = f"{STATUS}.{shakes.key}[{i}]"
        if not isinstance(h, Mapping):
            raise SpecError(hp, "an object", h)
        f = _fields(h, _HANDSHAKE_READ, hp)
        handshakes.append(Handshake(succeeded=f.pop("state") == HandshakeState.SUCCEEDED, **f))
    own = {k: v for k, v in status.items() if k != shakes.key}
    return Endpoint(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        labels=tuple(sorted((meta.get("labels") or {}).items())),
        deleting=bool(meta.get("deletionTimestamp")),
        **_fields(spec, ENDPOINT_FIELDS, "spec"),
        geometry=parse_geometry(_get(spec, GEOMETRY, "spec", Mapping)),
        handshakes=tuple(handshakes),
        status=own,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


# -- KVTransfer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == EXISTS:
            return present
        if self.operator == DOES_NOT_EXIST:
            return not present
        if self.operator == IN:
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values  # NotIn


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


@dataclass(frozen=True)
class ExpectedGeometry:
    block_size: int | None = None
    kv_cache_layout: str | None = None
    attention_backend: str | None = None
    num_regions: int | None = None


@dataclass(frozen=True)
class RoleSpec:
    tp_size: int
    selector: Selector | None = None
    expected: ExpectedGeometry | None = None


@dataclass(frozen=True)
class Transfer:
    name: str
    namespace: str
    generation: int
    protocol_version: int
    mode: str
    side_channel_port: int
    prefill: RoleSpec
    decode: RoleSpec
    policy: str = BALANCED
    topology_key: str = ""
    topology_required: bool = False  # pairing.topologyScope Required: never across zones
    prefill_per_decode: int = 1
    enforce_hash: bool = True
    accepted_transports: tuple[str, ...] = ()  # empty: any transport is accepted

    def role(self, role: str) -> RoleSpec:
        return self.prefill if role == PREFILL else self.decode


_ROLE, _REQ = ROLE_SPEC_FIELDS, REQUIREMENT_FIELDS


def parse_selector(raw: Any, path: str) -> Selector | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError(path, "a label selector object", raw)
    sel = _ROLE.selector.fields
    labels = sel.match_labels.get(raw) or {}
    reqs = [Requirement(k, IN, (v,)) for k, v in sorted(labels.items())]
    for i, e in enumerate(sel.match_expressions.get(raw) or ()):
        ep = f"{path}.{sel.match_expressions.key}[{i}]"
        op = _leaf(e, _REQ.operator, ep)
        values = tuple(_leaf(e, _REQ.values, ep))
        if op in (IN, NOT_IN) and not values:
            raise SpecError(f"{ep}.values", f"at least one value for operator {op}", [])
        if op in (EXISTS, DOES_NOT_EXIST) and values:
            raise SpecError(f"{ep}.values", f"no values for operator {op}", list(values))
        reqs.append(Requirement(_leaf(e, _REQ.key, ep), op, values))
    return Selector(tuple(reqs))


def parse_role(raw: Mapping[str, Any], path: str) -> RoleSpec:
    exp = _ROLE.expected.get(raw)
    expected = None
    if exp is not None:
        ep = f"{path}.{_ROLE.expected.key}"
        expected = ExpectedGeometry(**_fields(exp, _ROLE.expected.fields, ep))
    return RoleSpec(
        tp_size=_leaf(raw, _ROLE.tp_size, path),
        selector=parse_selector(_ROLE.selector.get(raw), f"{path}.{_ROLE.selector.key}"),
        expected=expected,
    )


def parse_transfer(body: Mapping[str, Any]) -> Transfer:
    """Parse a KVTransfer object (dict or kopf body). Raises :class:`SpecError`."""
    meta = body.get("metadata") or {}
    spec = _get(body, SPEC, "", Mapping)
    t = TRANSFER_SPEC_FIELDS
    pairing_key, compat_key, transport_key = (
        t.policy.parents[0], t.enforce_hash.parents[0], t.accepted_transports.parents[0])
    pairing = spec.get(pairing_key) or {}
    compat = spec.get(compat_key) or {}
    transport = _get(spec, transport_key, SPEC, Mapping, {})
    accepted = _leaf(transport, t.accepted_transports, f"{SPEC}.{transport_key}")
    for i, name in enumerate(accepted):
        if not isinstance(name, str) or not _TRANSPORT_NAME.match(name):
            raise SpecError(f"{SPEC}.{t.accepted_transports.key}[{i}]",
                            "a UCX transport name such as cma, tcp, rc or cuda_ipc", name)
    pp, cp = f"{SPEC}.{pairing_key}", f"{SPEC}.{compat_key}"
    return Transfer(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        generation=int(meta.get("generation") or 0),
        protocol_version=_leaf(spec, t.protocol_version, SPEC),
        mode=_leaf(spec, t.mode, SPEC),
        side_channel_port=_leaf(spec, t.side_channel_port, SPEC),
        prefill=parse_role(_get(spec, PREFILL, SPEC, Mapping), f"{SPEC}.{PREFILL}"),
        decode=parse_role(_get(spec, DECODE, SPEC, Mapping), f"{SPEC}.{DECODE}"),
        policy=_leaf(pairing, t.policy, pp),
        topology_key=_leaf(pairing, t.topology_key, pp),
        topology_required=_leaf(pairing, t.topology_scope, pp) == REQUIRED,
        prefill_per_decode=_leaf(pairing, t.prefill_per_decode, pp),
        enforce_hash=_leaf(compat, t.enforce_hash, cp),
        accepted_transports=tuple(accepted),
    )
