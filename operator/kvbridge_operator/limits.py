"""How big an object the CRD schemas admit, and what the path every object takes can carry.
Pure.

Every KVEndpoint and KVTransfer the schema admits must be creatable, updatable and deletable
through the apiserver, the admission webhook and the operator. :func:`largest` builds the
largest instance of a structural schema (every array at ``maxItems``, every string at
``maxLength``, every map at ``maxProperties``, the longest enum value and integer), so a test
can compare its serialized size with the limits below and create it on a real control plane.
A field with no bound raises :class:`UnboundedError` naming it: a schema without bounds has no
worst case, and so no guarantee.

The limits (Kubernetes 1.20 defaults, unchanged in later versions):

- etcd refuses a request over 1.5 MiB (``--max-request-bytes``): the whole stored object,
  metadata included, must fit;
- the apiserver caps the sum of an object's annotations at 256 KiB; ``kubectl apply`` (client
  side) copies the object into ``kubectl.kubernetes.io/last-applied-configuration``;
- the webhook reads an UPDATE's AdmissionReview, which carries the object and its old
  version (see :data:`~kvbridge_operator.webhook.MAX_REVIEW_BYTES`).

The budgets keep the schema-bounded part of an object (``spec`` and ``status``) well inside
them, leaving the rest for what no schema bounds: labels, annotations, managedFields,
ownerReferences.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from . import syntax
from .errors import OperatorError

#: etcd's default ``--max-request-bytes``: the largest object that can be stored.
ETCD_REQUEST_BYTES = 1536 * 1024
#: The apiserver's cap on the total size of an object's annotations.
ANNOTATIONS_BYTES = 256 * 1024
#: Budget for ``spec`` + ``status`` of the largest admitted object: two thirds of etcd's
#: limit, the rest for metadata (up to 256 KiB of annotations, labels, managedFields).
OBJECT_BUDGET = 1024 * 1024
#: Budget for the largest KVTransfer ``spec``: ``kubectl apply`` stores a copy of it in an
#: annotation, which must fit beside the user's own annotations.
APPLIED_SPEC_BUDGET = 128 * 1024

#: Sample values for formats and patterns that no repeated character satisfies.
DATE_TIME = "2006-01-02T15:04:05.999999999Z"
UUID = "01234567-89ab-cdef-0123-456789abcdef"
_FILLERS = "a0A"
_INT64 = (2**63 - 1, -(2**63))
#: Top-level fields the apiserver bounds and fills, not the CRD's schema.
_SET_BY_THE_APISERVER = ("apiVersion", "kind", "metadata")


class UnboundedError(OperatorError, ValueError):
    """A schema field admits values of any size."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}; the schema must bound it")
        self.path = path


def size(obj: Any) -> int:
    """Bytes of ``obj`` as compact JSON (how the apiserver stores custom resources)."""
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def crd_schema(crd: Mapping[str, Any], version: str | None = None) -> Mapping[str, Any]:
    """The openAPIV3Schema of ``version`` (default: the storage version) of a CRD document."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version or (version is None and v.get("storage")):
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd['metadata']['name']}: no version {version or '(storage)'}")


def largest(schema: Mapping[str, Any], path: str = "") -> Any:
    """The largest instance of ``schema`` (see module docstring); raises
    :class:`UnboundedError` for a field without a bound."""
    if "enum" in schema:
        return max(schema["enum"], key=size)
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, path)
    if kind == "array":
        if "maxItems" not in schema:
            raise UnboundedError(path, "an array without maxItems")
        item = json.dumps(largest(schema.get("items") or {}, f"{path}[*]"))
        return [json.loads(item) for _ in range(int(schema["maxItems"]))]
    if kind == "string":
        return _string(schema, path)
    if kind == "integer":
        candidates = [schema[k] for k in ("minimum", "maximum") if k in schema]
        if "maximum" not in schema:
            candidates.append(_INT64[0])
        if "minimum" not in schema:
            candidates.append(_INT64[1])
        return max(candidates, key=lambda v: len(str(v)))
    if kind == "boolean":
        return False
    raise UnboundedError(path or "(root)", f"type {kind!r} has no known worst case")


def _object(schema: Mapping[str, Any], path: str) -> dict[str, Any]:
    out = {
        k: largest(sub, f"{path}.{k}" if path else k)
        for k, sub in (schema.get("properties") or {}).items()
        if path or k not in _SET_BY_THE_APISERVER
    }
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        if "maxProperties" not in schema:
            raise UnboundedError(path, "a map without maxProperties")
        # The only maps in these CRDs are label selectors: their keys are label keys,
        # bounded by the webhook (syntax.label_key), not by the schema.
        for i in range(int(schema["maxProperties"])):
            out[longest_label_key(i)] = largest(extra, f"{path}[*]")
    elif schema.get("x-kubernetes-preserve-unknown-fields"):
        raise UnboundedError(path, "an object that preserves unknown fields")
    return out


def _string(schema: Mapping[str, Any], path: str) -> str:
    if schema.get("format") == "date-time":
        return DATE_TIME
    if "maxLength" not in schema:
        raise UnboundedError(path, "a string without maxLength")
    length = int(schema["maxLength"])
    pattern = schema.get("pattern")
    if pattern is None:
        return "a" * length
    compiled = re.compile(pattern)
    for candidate in (*(c * length for c in _FILLERS), UUID):
        if len(candidate) <= length and compiled.search(candidate):
            return candidate
    raise UnboundedError(path, f"no sample of length {length} matches {pattern!r}")


def longest_dns_name() -> str:
    """A valid DNS subdomain of the greatest length (253, in labels of at most 63)."""
    label = "a" * syntax.DNS_LABEL_MAX
    name = ".".join([label, label, label, "a" * 61])
    assert len(name) == syntax.DNS_SUBDOMAIN_MAX and syntax.dns_subdomain(name) is None
    return name


def longest_label_key(i: int) -> str:
    """A valid label key of the greatest length Kubernetes allows, unique for each ``i``:
    a 253-character DNS-subdomain prefix and a 63-character name."""
    key = f"{longest_dns_name()}/{f'k{i}'.ljust(syntax.LABEL_NAME_MAX, 'a')}"
    assert syntax.label_key(key) is None, key
    return key
