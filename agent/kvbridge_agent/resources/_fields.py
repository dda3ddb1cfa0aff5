"""The KVEndpoint ``spec`` as one table of fields, and the table type the status tables
(:mod:`._status`) share. Pure.

Each :class:`EndpointField` says where a value sits in the document, what the parsed record
calls it, its type, whether it may be left out, and which wire field (a
``NixlAgentMetadata`` / ``EngineGeometry`` name) it carries. Everything that used to spell
the schema out by hand derives from these tables: the document the agent publishes
(:func:`endpoint_document`), the operator's parser, the KVEndpoint path an incompatibility
names (:func:`endpoint_path`) and the camelCase keys ``kvbridge probe --geometry`` accepts
(:func:`geometry_aliases`, :func:`region_aliases`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..rules import MEM_TYPES, MODES
from ._names import ROLES

__all__ = [
    "ENDPOINT_FIELDS",
    "GEOMETRY",
    "GEOMETRY_FIELDS",
    "NO_FIELDS",
    "REGIONS",
    "REGION_FIELDS",
    "EndpointField",
    "FieldTable",
    "document",
    "endpoint_document",
    "endpoint_path",
    "geometry_aliases",
    "region_aliases",
]

#: Keys of the nested parts of ``spec``.
GEOMETRY, REGIONS = "geometry", "regions"


class FieldTable(tuple["EndpointField", ...]):
    """A tuple of fields that also names each one by its ``attr``
    (``HANDSHAKE_FIELDS.state.key``), so readers and writers spell no key by hand."""

    def __new__(cls, fields: tuple[EndpointField, ...]) -> FieldTable:
        table = super().__new__(cls, fields)
        attrs = [f.attr for f in fields]
        if len(set(attrs)) != len(attrs) or any(hasattr(tuple, a) for a in attrs):
            raise ValueError(f"field table with duplicate or reserved attributes: {attrs}")
        table.__dict__.update((f.attr, f) for f in fields)  # plain attribute look-ups
        return table

    def __getattr__(self, attr: str) -> EndpointField:
        """Only reached for an attribute no field has (the fields are instance attributes)."""
        raise AttributeError(f"no field with attribute {attr!r}")


#: The ``fields`` of a field that nests none.
NO_FIELDS = FieldTable(())


@dataclass(frozen=True)
class EndpointField:
    """One field of a KVEndpoint or KVTransfer (``spec`` or ``status``).

    Attributes:
        key: its place under its part (``spec``, ``spec.geometry``, a region, ``status``, a
            ``status.peers`` item, ...), dotted when nested (``sideChannel.host``).
        attr: the attribute of the parsed record (and of the values the document takes).
        kind: its JSON type.
        required: the parser refuses a document without it; otherwise ``default`` is used.
        default: the value of a field left out.
        choices: the values allowed (an enum).
        wire: the wire field it carries, if any.
        omit_empty: the writer leaves the field out when it has no value (None, "" or 0).
        fields: for an object (``dict``) or a list of objects (``list``), the fields of the
            object or of each item.
    """

    key: str
    attr: str
    kind: type
    required: bool = True
    default: Any = None
    choices: tuple[str, ...] = ()
    wire: str = ""
    omit_empty: bool = False
    fields: FieldTable = NO_FIELDS

    # Cached: writers and readers ask for them per item of every status they touch.
    @cached_property
    def parents(self) -> tuple[str, ...]:
        return tuple(self.key.split(".")[:-1])

    @cached_property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def get(self, doc: Mapping[str, Any] | None, default: Any = None) -> Any:
        """Its value in ``doc`` (through its parents), or ``default`` where it or a parent is
        missing or null: how readers of documents others wrote look at them."""
        part: Any = doc
        for key in (*self.parents, self.name):
            part = part.get(key) if isinstance(part, Mapping) else None
            if part is None:
                return default
        return part

    def at(self, doc: Mapping[str, Any]) -> Any:
        """Its value in ``doc``; ``KeyError`` where it is missing (a field the reader needs)."""
        for key in self.parents:
            doc = doc[key]
        return doc[self.name]


def _f(key: str, attr: str, kind: type, *, default: Any = ..., **kw: Any) -> EndpointField:
    if default is ...:
        return EndpointField(key, attr, kind, **kw)
    return EndpointField(key, attr, kind, required=False, default=default, **kw)


#: ``spec``, in the order the parser checks it.
ENDPOINT_FIELDS = FieldTable((
    _f("role", "role", str, choices=ROLES),
    _f("transferName", "transfer", str),
    _f("engineId", "engine_id", str, wire="engine_id"),
    _f("podName", "pod_name", str),
    _f("podUID", "pod_uid", str, default="", omit_empty=True),
    _f("nodeName", "node_name", str, default="", omit_empty=True),
    _f("sideChannel.host", "host", str),
    _f("sideChannel.port", "port", int),
    _f("tpRank", "tp_rank", int, wire="tp_rank"),
    _f("tpSize", "tp_size", int, wire="tp_size"),
    _f("dpIndex", "dp_index", int, default=0),
    _f("protocolVersion", "protocol_version", int, wire="protocol_version"),
    _f("compatibilityHash", "compatibility_hash", str, default=None,
       wire="compatibility_hash"),
    _f("mode", "mode", str, choices=MODES, wire="transfer_mode"),
    _f("epoch", "epoch", int),
    #: the engine's OpenAI port, which the router reaches it on (KVBRIDGE_SERVING_PORT)
    _f("servingPort", "serving_port", int, default=0, omit_empty=True),
    #: the engine's KV-event publisher, which cache-aware routers subscribe to
    #: (vLLM --kv-events-config, or KVBRIDGE_KV_EVENTS_PORT)
    _f("kvEventsPort", "kv_events_port", int, default=0, omit_empty=True),
    #: what the engine serves: endpoints pair only within one model fingerprint (and revision)
    _f("model.name", "model_name", str, default="", omit_empty=True),
    _f("model.revision", "model_revision", str, default="", omit_empty=True),
    _f("model.fingerprint", "model_fingerprint", str, default="", omit_empty=True),
    _f("versions.vllm", "vllm_version", str, default="", omit_empty=True),
    _f("versions.kvbridge", "kvbridge_version", str, default="", omit_empty=True),
))

#: ``spec.geometry`` (its ``regions`` list aside).
GEOMETRY_FIELDS = FieldTable((
    _f("blockSize", "block_size", int, wire="block_size"),
    _f("physicalBlocksPerLogical", "physical_blocks_per_logical", int, default=1,
       wire="physical_blocks_per_logical_kv_block"),
    _f("numBlocks", "num_blocks", int, wire="num_blocks"),
    _f("kvCacheLayout", "kv_cache_layout", str, wire="kv_cache_layout"),
    _f("attentionBackend", "attention_backend", str, default="", wire="attn_backend_name"),
    _f("isMla", "is_mla", bool, default=False, wire="is_mla"),
    _f("numKvHeads", "num_kv_heads", int, default=None, wire="num_kv_heads",
       omit_empty=True),
    _f("dcpSize", "dcp_size", int, default=1, wire="dcp_size"),
    _f("pcpSize", "pcp_size", int, default=1, wire="pcp_size"),
))

#: One item of ``spec.geometry.regions``; ``wire`` is the per-region list it is part of.
REGION_FIELDS = FieldTable((
    _f("name", "name", str, wire="region_names"),
    _f("numBlocks", "num_blocks", int, wire="region_num_blocks"),
    _f("groupId", "group_id", int, wire="region_group_ids"),
    _f("memType", "mem_type", str, choices=MEM_TYPES, wire="region_mem_types"),
    _f("blockLen", "block_len", int, wire="block_lens"),
    _f("blockStride", "block_stride", int, wire="block_strides"),
))


# -- the document -------------------------------------------------------------------------------

def _empty(value: Any) -> bool:
    return value is None or value == "" or (value == 0 and not isinstance(value, bool))


def _fill(out: dict[str, Any], table: Sequence[EndpointField], values: Mapping[str, Any]
          ) -> dict[str, Any]:
    for f in table:
        value = values[f.attr] if f.required or not f.omit_empty else values.get(f.attr)
        _place(out, f, value)
    return out


def _place(out: dict[str, Any], f: EndpointField, value: Any) -> None:
    """Write one field's value at its path, leaving an empty ``omit_empty`` field out."""
    if f.omit_empty and _empty(value):
        return
    part = out
    for parent in f.parents:
        part = part.setdefault(parent, {})
    part[f.name] = value


def document(table: Sequence[EndpointField], values: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a document ``table`` describes, from values keyed by ``attr``: a field
    missing from ``values`` is left out, and so is an empty one with ``omit_empty``."""
    out: dict[str, Any] = {}
    for f in table:
        if f.attr in values:
            _place(out, f, values[f.attr])
    return out


def endpoint_document(spec: Mapping[str, Any], geometry: Mapping[str, Any],
                      regions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The KVEndpoint ``spec`` from values keyed by each table's ``attr`` (a field with
    ``omit_empty`` may be missing or empty: it is left out)."""
    g = _fill({}, GEOMETRY_FIELDS, geometry)
    g[REGIONS] = [_fill({}, REGION_FIELDS, r) for r in regions]
    out = _fill({}, ENDPOINT_FIELDS, spec)
    out[GEOMETRY] = g
    return out


# -- the path an incompatibility names ------------------------------------------------------------

_WIRE_PATHS = {
    **{f.wire: f"spec.{f.key}" for f in ENDPOINT_FIELDS if f.wire},
    **{f.wire: f"spec.{GEOMETRY}.{f.key}" for f in GEOMETRY_FIELDS if f.wire},
}
#: per-region lists -> the key of a region item ("": the region itself)
_REGION_KEYS = {**{f.wire: f.key for f in REGION_FIELDS}, "kv_caches_base_addr": ""}
_REGIONS_PATH = f"spec.{GEOMETRY}.{REGIONS}"
_INDEXED = re.compile(r"(\w+)\[(\d+)\]")
_LENGTH = re.compile(r"len\((\w+)\)")


def endpoint_path(wire_field: str) -> str:
    """The KVEndpoint path of a wire field as an ``Incompatibility`` names it
    (``block_lens[2]`` -> ``spec.geometry.regions[2].blockLen``); unknown ones as given."""
    if m := _INDEXED.fullmatch(wire_field):
        sub = _REGION_KEYS.get(m.group(1))
        if sub is not None:
            return f"{_REGIONS_PATH}[{m.group(2)}]" + (f".{sub}" if sub else "")
    if _LENGTH.fullmatch(wire_field):
        return _REGIONS_PATH
    if wire_field in _REGION_KEYS:
        sub = _REGION_KEYS[wire_field]
        return f"{_REGIONS_PATH}[*]" + (f".{sub}" if sub else "")
    return _WIRE_PATHS.get(wire_field, wire_field)


# -- the camelCase spellings a geometry file may use -----------------------------------------------

def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.title() for w in rest)


def geometry_aliases(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """camelCase key -> ``EngineGeometry`` field: each wire field's KVEndpoint key and its
    own name in camelCase, plus ``extra`` spellings."""
    out: dict[str, str] = {}
    for f in (*ENDPOINT_FIELDS, *GEOMETRY_FIELDS, *REGION_FIELDS):
        if f.wire:
            out[_camel(f.wire)] = f.wire
            if f not in REGION_FIELDS:
                out[f.name] = f.wire
    return {**out, **extra}


def region_aliases() -> dict[str, str]:
    """A region item's camelCase key -> ``RegionGeometry`` field (where they differ)."""
    return {f.key: f.attr for f in REGION_FIELDS if f.key != f.attr}
