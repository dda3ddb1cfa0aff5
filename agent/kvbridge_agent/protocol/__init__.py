"""vLLM NIXL connector version-11 handshake: wire structures, hash and validation.

Pure: imports msgspec, hashlib and the standard library only (no ZMQ, NIXL or Kubernetes),
so the operator validates KVEndpoints with exactly the rules the agent's handshake applies.

- Wire (spec §1.1-§1.3): :class:`NixlAgentMetadata`, :class:`NixlHandshakePayload`,
  ``encode_*``/``decode_*``, :func:`decode_handshake` (two-phase: payload, hash, metadata).
- Hash (§1.5): :class:`CompatibilityFactors`, :func:`compatibility_hash`,
  :func:`check_compatibility`.
- Validation (§1.6, §10.11): :class:`EngineGeometry`, :func:`validate_remote` returning a
  :class:`Verdict` of :class:`Incompatibility` items; :func:`effective_regions` applies the
  v10 fallbacks.
- Version (§1.4, §1.7): :func:`read_peer_version` reads a peer's connector version from its
  metadata keys before the hash; :data:`SUPPORTED_CONNECTOR_VERSIONS`.
- Errors: every failure is a :class:`ProtocolError` (``ValueError``).

spec §N: sections of docs/protocol.md.
"""

from ..rules import NIXL_CONNECTOR_VERSION
from ._compat import CompatibilityFactors, check_compatibility, compatibility_hash
from ._consistency import MEMORY_TYPES, check_metadata
from ._engine import EffectiveRegions, EngineGeometry, RegionGeometry, effective_regions
from ._errors import (
    ConnectorVersionError,
    EngineIdMismatchError,
    HashMismatchError,
    MetadataDecodeError,
    PayloadDecodeError,
    ProtocolError,
    RequestDecodeError,
    TimestampDecodeError,
)
from ._validate import validate_remote
from ._verdict import (
    Incompatibility,
    IncompatibleGeometryError,
    Mode,
    Rule,
    ValidationOptions,
    Verdict,
)
from ._version import (
    SUPPORTED_CONNECTOR_VERSIONS,
    PeerVersion,
    read_peer_version,
)
from ._wire import (
    GET_META_MSG,
    SHARED_REGION_GROUP_ID,
    NixlAgentMetadata,
    NixlHandshakePayload,
    decode_handshake,
    decode_metadata,
    decode_payload,
    decode_request,
    decode_timestamp,
    encode_metadata,
    encode_payload,
    encode_request,
    encode_timestamp,
    make_payload,
)

__all__ = [
    "GET_META_MSG",
    "MEMORY_TYPES",
    "NIXL_CONNECTOR_VERSION",
    "SHARED_REGION_GROUP_ID",
    "SUPPORTED_CONNECTOR_VERSIONS",
    "CompatibilityFactors",
    "ConnectorVersionError",
    "EffectiveRegions",
    "EngineGeometry",
    "EngineIdMismatchError",
    "HashMismatchError",
    "Incompatibility",
    "IncompatibleGeometryError",
    "MetadataDecodeError",
    "Mode",
    "NixlAgentMetadata",
    "NixlHandshakePayload",
    "PayloadDecodeError",
    "PeerVersion",
    "ProtocolError",
    "RegionGeometry",
    "RequestDecodeError",
    "Rule",
    "TimestampDecodeError",
    "ValidationOptions",
    "Verdict",
    "check_compatibility",
    "check_metadata",
    "compatibility_hash",
    "decode_handshake",
    "decode_metadata",
    "decode_payload",
    "decode_request",
    "decode_timestamp",
    "effective_regions",
    "encode_metadata",
    "encode_payload",
    "encode_request",
    "encode_timestamp",
    "make_payload",
    "read_peer_version",
    "validate_remote",
]
