"""Wire structures of the vLLM NIXL connector handshake at version 11 (spec §1.1-§1.3).

Everything is msgspec msgpack. Structs encode as maps keyed by field name, in declaration
order; the declaration order below is the order of spec §1.3 so that our bytes equal vLLM's
(and the vectors in ``spec/vectors/v11-handshake.json``) exactly. Decoding ignores unknown
keys and fills missing optional keys with their defaults, which is what lets v10 and v11
peers read each other's blobs (§1.7). Never pickle.
"""

from __future__ import annotations

import math

import msgspec

from ..rules import SHARED_GROUP_ID
from ._compat import check_compatibility
from ._errors import (
    EngineIdMismatchError,
    MetadataDecodeError,
    PayloadDecodeError,
    RequestDecodeError,
    TimestampDecodeError,
)
from ._version import check_peer_version

GET_META_MSG = b"get_meta_msg"
"""First item of a side-channel request (spec §1.1)."""

SHARED_REGION_GROUP_ID = SHARED_GROUP_ID
"""``region_group_ids`` value of a region overlaid by several transfer groups (spec §1.3)."""


class NixlAgentMetadata(msgspec.Struct, kw_only=True):
    """Per-rank engine metadata, spec §1.3 (field names, order and defaults are the wire).

    Every per-region list has length R and the same region order. The four v11 fields are
    ``None`` only when decoded from an older (v10) peer; a v11 producer always fills them.
    """

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1

    @property
    def num_regions(self) -> int:
        """R, the number of transfer regions (length of ``kv_caches_base_addr``)."""
        return len(self.kv_caches_base_addr)

    @property
    def is_v11(self) -> bool:
        """True when all four v11 per-region fields are present."""
        return None not in (
            self.region_num_blocks,
            self.region_group_ids,
            self.region_names,
            self.region_mem_types,
        )


class NixlHandshakePayload(msgspec.Struct, kw_only=True):
    """Outer reply frame: the hash is checked before ``agent_metadata_bytes`` is decoded."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(NixlAgentMetadata)
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(NixlHandshakePayload)
_REQUEST_DECODER = msgspec.msgpack.Decoder(tuple[bytes, int, int])
_FLOAT_DECODER = msgspec.msgpack.Decoder(float)


def encode_metadata(meta: NixlAgentMetadata) -> bytes:
    """Encode ``meta`` as the msgpack map vLLM puts in ``agent_metadata_bytes``."""
    return _ENCODER.encode(meta)


def decode_metadata(buf: bytes | memoryview) -> NixlAgentMetadata:
    """Decode a metadata map; raises :class:`MetadataDecodeError` on any malformed input."""
    try:
        return _META_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MetadataDecodeError(str(exc)) from exc


def encode_payload(payload: NixlHandshakePayload) -> bytes:
    """Encode the outer payload (first reply frame)."""
    return _ENCODER.encode(payload)


def decode_payload(buf: bytes | memoryview) -> NixlHandshakePayload:
    """Decode the outer payload only; raises :class:`PayloadDecodeError`."""
    try:
        return _PAYLOAD_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PayloadDecodeError(str(exc)) from exc


def make_payload(meta: NixlAgentMetadata, compatibility_hash: str) -> NixlHandshakePayload:
    """Wrap ``meta`` with the local hash, as a producer does once at startup."""
    return NixlHandshakePayload(
        compatibility_hash=compatibility_hash, agent_metadata_bytes=encode_metadata(meta)
    )


def decode_handshake(
    buf: bytes | memoryview,
    *,
    local_hash: str | None = None,
    enforce_handshake_compat: bool = True,
    expected_engine_id: str | None = None,
) -> tuple[NixlHandshakePayload, NixlAgentMetadata]:
    """Two-phase decode of a reply frame, in the order of spec §1.2.

    1. outer payload (:class:`PayloadDecodeError`); 2. the peer's connector version, read
    leniently from the metadata keys (:class:`ConnectorVersionError` unless supported,
    whether or not the hash is checked); 3. hash against ``local_hash`` when one is given
    (:class:`HashMismatchError` if enforced, a logged warning otherwise); 4. inner metadata
    (:class:`MetadataDecodeError`); 5. ``engine_id`` against ``expected_engine_id`` when given
    (:class:`EngineIdMismatchError`).
    """
    payload = decode_payload(buf)
    check_peer_version(payload.agent_metadata_bytes)
    if local_hash is not None:
        check_compatibility(
            local_hash, payload.compatibility_hash, enforce=enforce_handshake_compat
        )
    meta = decode_metadata(payload.agent_metadata_bytes)
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise EngineIdMismatchError(expected_engine_id, meta.engine_id)
    return payload, meta


def encode_request(pp_rank: int, tp_rank: int) -> bytes:
    """The request frame ``[b"get_meta_msg", pp_rank, tp_rank]`` (spec §1.1)."""
    return _ENCODER.encode((GET_META_MSG, pp_rank, tp_rank))


def decode_request(buf: bytes | memoryview) -> tuple[int, int]:
    """Parse a request frame into ``(pp_rank, tp_rank)``; raises :class:`RequestDecodeError`."""
    try:
        msg, pp_rank, tp_rank = _REQUEST_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestDecodeError(f"malformed side-channel request: {exc}") from exc
    if msg != GET_META_MSG:
        raise RequestDecodeError(
            f"side-channel request: expected message {GET_META_MSG!r}, got {msg[:64]!r}"
        )
    return pp_rank, tp_rank


def encode_timestamp(perf_counter: float) -> bytes:
    """Second reply frame: a msgpack float64 of the server's ``time.perf_counter()``."""
    return _ENCODER.encode(float(perf_counter))


def decode_timestamp(buf: bytes | memoryview) -> float:
    """Parse the second reply frame; raises :class:`TimestampDecodeError`."""
    try:
        value = _FLOAT_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TimestampDecodeError(f"reply timestamp frame: {exc}") from exc
    if not math.isfinite(value):
        raise TimestampDecodeError(f"reply timestamp frame: expected a finite float, got {value}")
    return value
