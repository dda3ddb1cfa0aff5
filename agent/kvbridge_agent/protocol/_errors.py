"""The protocol error tree.

Every failure of the pure protocol layer is a :class:`ProtocolError` (a ``ValueError``), so
callers can catch the family at one boundary. Messages follow spec §1.2/§1.5 where the spec
gives vLLM's wording, so logs from a kvbridge engine and from a vLLM engine read alike.
"""

from __future__ import annotations

from ..errors import KVBridgeError

_DISABLE_HINT = (
    "Disable this check using --kv-transfer-config "
    '\'{"kv_connector_extra_config": {"enforce_handshake_compat": false}}\''
)


class ProtocolError(KVBridgeError, ValueError):
    """Base class of every error raised by :mod:`kvbridge_agent.protocol`."""


class RequestDecodeError(ProtocolError):
    """A side-channel request frame is not ``[b"get_meta_msg", pp_rank, tp_rank]``."""


class PayloadDecodeError(ProtocolError):
    """The outer ``NixlHandshakePayload`` could not be decoded (phase 1 of spec §1.2)."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"Failed to decode NixlHandshakePayload ({detail}). This typically indicates an "
            "incompatibility between connector versions on the prefill and decode instances."
        )
        self.detail = detail


class MetadataDecodeError(ProtocolError):
    """The inner ``NixlAgentMetadata`` could not be decoded (phase 3 of spec §1.2)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"Failed to decode NixlAgentMetadata ({detail})")
        self.detail = detail


class ConnectorVersionError(ProtocolError):
    """The peer speaks a NIXL connector version kvbridge does not (spec §1.7); raised before
    the hash check, so the user reads both versions instead of two opaque hashes."""

    def __init__(self, peer_version: int | None, evidence: str, *, local_release: str,
                 local_version: int, supported: tuple[int, ...]) -> None:
        said = (f"NIXL connector version {peer_version}" if peer_version is not None
                else "a NIXL connector version kvbridge does not know")
        super().__init__(
            f"peer speaks {said}; kvbridge {local_release} speaks {local_version} "
            f"(supported: {', '.join(map(str, supported))}): {evidence}. Run both sides at a "
            "supported version (enforce_handshake_compat=false does not lift this)")
        self.peer_version = peer_version
        self.local_version = local_version
        self.supported = supported


class TimestampDecodeError(ProtocolError):
    """The second reply frame is not a msgpack float (the server's perf counter)."""


class HashMismatchError(ProtocolError):
    """The compatibility hashes differ and enforcement is on (spec §1.5)."""

    def __init__(self, local_hash: str, remote_hash: str) -> None:
        super().__init__(
            f"NIXL compatibility hash mismatch. Local: {local_hash}, Remote: {remote_hash}. "
            "Prefill and decode instances have incompatible configurations (vLLM version, "
            "connector version, model, dtype, KV heads, head size, layers, attention backend, "
            f"cache dtype, HMA, speculative config or transfer mode differ). {_DISABLE_HINT}"
        )
        self.local_hash = local_hash
        self.remote_hash = remote_hash


class EngineIdMismatchError(ProtocolError):
    """The remote metadata names another engine than the request expected (spec §1.2)."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(
            f"Remote NIXL agent engine ID mismatch: expected {expected!r} "
            f"(remote_engine_id of the request), got {actual!r} from the side channel"
        )
        self.expected = expected
        self.actual = actual
