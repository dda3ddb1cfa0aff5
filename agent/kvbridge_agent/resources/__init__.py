"""The Kubernetes resources' shared facts, pure: the API names, roles and default deadlines
(:mod:`._names`) and the KVEndpoint ``spec`` as one field table (:mod:`._fields`), which the
agent's document, the operator's parser, error paths and the CLI's aliases derive from."""

from ._fields import (
    ENDPOINT_FIELDS,
    GEOMETRY,
    GEOMETRY_FIELDS,
    REGION_FIELDS,
    REGIONS,
    EndpointField,
    endpoint_document,
    endpoint_path,
    geometry_aliases,
    region_aliases,
)
from ._names import (
    API_VERSION,
    DECODE,
    ENDPOINT_KIND,
    ENDPOINTS,
    GROUP,
    HANDSHAKE_TIMEOUT_S,
    PREFILL,
    ROLES,
    TRANSFER_KIND,
    TRANSFER_TIMEOUT_S,
    TRANSFERS,
    VERSION,
)

__all__ = [
    "API_VERSION",
    "DECODE",
    "ENDPOINTS",
    "ENDPOINT_FIELDS",
    "ENDPOINT_KIND",
    "GEOMETRY",
    "GEOMETRY_FIELDS",
    "GROUP",
    "HANDSHAKE_TIMEOUT_S",
    "PREFILL",
    "REGIONS",
    "REGION_FIELDS",
    "ROLES",
    "TRANSFERS",
    "TRANSFER_KIND",
    "TRANSFER_TIMEOUT_S",
    "VERSION",
    "EndpointField",
    "endpoint_document",
    "endpoint_path",
    "geometry_aliases",
    "region_aliases",
]
