"""The CRD YAMLs and the shared field tables describe the same documents, both ways: every
property, its type, whether it is required, its enum and its default (where the CRD states
one). A field added, renamed or re-typed on one side alone fails here."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.resources import (
    ENDPOINT_FIELDS,
    ENDPOINT_STATUS_FIELDS,
    GEOMETRY,
    GEOMETRY_FIELDS,
    REGION_FIELDS,
    REGIONS,
    TRANSFER_SPEC_FIELDS,
    TRANSFER_STATUS_FIELDS,
    EndpointField,
    FieldTable,
)

CRDS = Path(__file__).resolve().parents[2] / "crds"
_TYPES = {str: "string", int: "integer", bool: "boolean", list: "array", dict: "object"}
#: (type, required, sorted enum, default or _NO_DEFAULT) per dotted path ("[]" for items)
Shape = tuple[str, bool, tuple[str, ...], Any]
_NO_DEFAULT = "<none>"


def _schema(crd: str) -> Mapping[str, Any]:
    doc = yaml.safe_load((CRDS / crd).read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def crd_shapes(schema: Mapping[str, Any], prefix: str = "") -> dict[str, Shape]:
    """Every property under ``schema``, nested objects and object items included."""
    out: dict[str, Shape] = {}
    required = set(schema.get("required") or ())
    for name, sub in (schema.get("properties") or {}).items():
        path = prefix + name
        kind = sub.get("type", "")
        # the table states a default only where the CRD does (the others are the reader's)
        out[path] = (kind, name in required, tuple(sorted(sub.get("enum") or ())),
                     sub.get("default", _NO_DEFAULT))
        if kind == "object" and "properties" in sub:
            out.update(crd_shapes(sub, path + "."))
        items = sub.get("items") or {}
        if kind == "array" and items.get("type") == "object":
            out.update(crd_shapes(items, path + "[]."))
    return out


def table_shapes(table: Sequence[EndpointField], prefix: str = "",
                 defaults: Mapping[str, Any] = {}) -> dict[str, Shape]:  # fmt: skip
    """The same for a field table: dotted keys make their parents objects (required when a
    child is), ``fields`` nest."""
    out: dict[str, Shape] = {}
    for f in table:
        for i in range(1, len(f.parents) + 1):
            path = prefix + ".".join(f.parents[:i])
            required = out.get(path, ("", False))[1] or f.required
            out[path] = ("object", required, (), defaults.get(path, _NO_DEFAULT))
        path = prefix + f.key
        out[path] = (_TYPES[f.kind], f.required, tuple(sorted(f.choices)),
                     defaults.get(path, _NO_DEFAULT))
        if f.fields:
            sub = path + ("[]." if f.kind is list else ".")
            out.update(table_shapes(f.fields, sub, defaults))
    return out


def _with_defaults(shapes: dict[str, Shape], table: Sequence[EndpointField],
                   crd: Mapping[str, Shape], prefix: str = "") -> dict[str, Shape]:  # fmt: skip
    """Put each table default in where the CRD states one, so a differing value shows."""
    for f in table:
        path = prefix + f.key
        if crd.get(path, (None,) * 4)[3] != _NO_DEFAULT and path in shapes:
            shapes[path] = (*shapes[path][:3], f.default)
        if f.fields:
            _with_defaults(shapes, f.fields, crd, path + ("[]." if f.kind is list else "."))
    return shapes


def endpoint_spec_shapes() -> dict[str, Shape]:
    return {
        **table_shapes(ENDPOINT_FIELDS),
        GEOMETRY: ("object", True, (), _NO_DEFAULT),
        **table_shapes(GEOMETRY_FIELDS, f"{GEOMETRY}."),
        f"{GEOMETRY}.{REGIONS}": ("array", True, (), _NO_DEFAULT),
        **table_shapes(REGION_FIELDS, f"{GEOMETRY}.{REGIONS}[]."),
    }


def mismatches(crd: Mapping[str, Shape], table: Mapping[str, Shape]) -> list[str]:
    """What differs, one line per path (empty: they agree)."""
    out = [f"{p}: in the CRD, not in the table" for p in sorted(crd.keys() - table.keys())]
    out += [f"{p}: in the table, not in the CRD" for p in sorted(table.keys() - crd.keys())]
    out += [f"{p}: CRD {crd[p]} != table {table[p]}"
            for p in sorted(crd.keys() & table.keys()) if crd[p] != table[p]]  # fmt: skip
    return out


def _part(crd: str, part: str) -> dict[str, Shape]:
    return crd_shapes(_schema(crd)["properties"][part])


CASES = {
    "KVEndpoint spec": ("kvbridge.io_kvendpoints.yaml", "spec", endpoint_spec_shapes,
                        (ENDPOINT_FIELDS, GEOMETRY_FIELDS, REGION_FIELDS)),
    "KVEndpoint status": ("kvbridge.io_kvendpoints.yaml", "status",
                          lambda: table_shapes(ENDPOINT_STATUS_FIELDS),
                          (ENDPOINT_STATUS_FIELDS,)),
    "KVTransfer spec": ("kvbridge.io_kvtransfers.yaml", "spec",
                        lambda: table_shapes(TRANSFER_SPEC_FIELDS), (TRANSFER_SPEC_FIELDS,)),
    "KVTransfer status": ("kvbridge.io_kvtransfers.yaml", "status",
                          lambda: table_shapes(TRANSFER_STATUS_FIELDS),
                          (TRANSFER_STATUS_FIELDS,)),
}


def _shapes(case: str) -> tuple[dict[str, Shape], dict[str, Shape]]:
    crd_file, part, tables, _ = CASES[case]
    crd = _part(crd_file, part)
    table = tables()
    for t in CASES[case][3]:
        _with_defaults(table, t, crd)
    return crd, table


@pytest.mark.parametrize("case", sorted(CASES))
def test_crd_matches_field_table(case: str) -> None:
    crd, table = _shapes(case)
    assert mismatches(crd, table) == []


def test_a_change_on_one_side_alone_is_caught() -> None:
    crd, table = _shapes("KVEndpoint status")
    # the CRD loses a property, gains a state, or stops requiring a field
    gone = {p: s for p, s in crd.items() if p != "handshakes[].transportDetail"}
    assert mismatches(gone, table) == ["handshakes[].transportDetail: in the table, not in the CRD"]
    state = crd["state"]
    more = {**crd, "state": (state[0], state[1], tuple(sorted((*state[2], "Lost"))), state[3])}
    assert len(mismatches(more, table)) == 1
    peer = crd["peers[].epoch"]
    loose = {**crd, "peers[].epoch": (peer[0], False, *peer[2:])}
    assert len(mismatches(loose, table)) == 1
    # the table gains a field or a field changes type
    extra = FieldTable((*ENDPOINT_STATUS_FIELDS, EndpointField("lostAt", "lost_at", str, False)))
    assert mismatches(crd, table_shapes(extra)) == ["lostAt: in the table, not in the CRD"]
    retyped = FieldTable(tuple(dataclasses.replace(f, kind=int) if f.key == "reason" else f
                               for f in ENDPOINT_STATUS_FIELDS))  # fmt: skip
    assert len(mismatches(crd, table_shapes(retyped))) == 1


def test_a_crd_default_that_differs_is_caught() -> None:
    schema = copy.deepcopy(_schema("kvbridge.io_kvtransfers.yaml"))
    schema["properties"]["spec"]["properties"]["sideChannelPort"]["default"] = 5700
    crd = crd_shapes(schema["properties"]["spec"])
    table = _with_defaults(table_shapes(TRANSFER_SPEC_FIELDS), TRANSFER_SPEC_FIELDS, crd)
    assert mismatches(crd, table) == [
        "sideChannelPort: CRD ('integer', False, (), 5700) != table ('integer', False, (), 5600)"
    ]


def test_the_records_written_through_a_table_have_its_fields() -> None:
    """The operator writes these records through ``document``, which keeps only the table's
    fields: a record field the table lacks would silently never reach the status."""
    from kvbridge_agent.resources import PEER_FIELDS, ROLE_COUNT_FIELDS
    from kvbridge_operator.model import Peer, RoleCounts

    for record, table in ((Peer, PEER_FIELDS), (RoleCounts, ROLE_COUNT_FIELDS)):
        assert [f.name for f in dataclasses.fields(record)] == [f.attr for f in table]
