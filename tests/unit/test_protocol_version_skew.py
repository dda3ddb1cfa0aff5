"""A peer's NIXL connector version is read from its metadata keys before the hash check, and
a peer at another version than 10 or 11 is refused with both versions named (spec §1.7)."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge_agent import __version__
from kvbridge_agent.protocol import (
    SUPPORTED_CONNECTOR_VERSIONS,
    ConnectorVersionError,
    HashMismatchError,
    ProtocolError,
    decode_handshake,
    read_peer_version,
)
from skew_payloads import V11, metadata_map, payload, v12_hash, v12_metadata, v12_payload

V11_HASH = V11["payload_compatibility_hash"]
V12_MESSAGE = (f"peer speaks NIXL connector version 12; kvbridge {__version__} speaks 11 "
               "(supported: 10, 11)")


def _encode(meta: dict) -> bytes:
    return msgspec.msgpack.encode(meta)


def _v10_metadata(*, nil: bool) -> dict:
    meta = metadata_map()
    for key in ("region_num_blocks", "region_group_ids", "region_names", "region_mem_types"):
        if nil:
            meta[key] = None
        else:
            del meta[key]
    return meta


def test_supported_versions_are_10_and_11() -> None:
    assert SUPPORTED_CONNECTOR_VERSIONS == (10, 11)


@pytest.mark.parametrize(("meta", "version"), [
    (metadata_map(), 11),
    (v12_metadata(), 12),
    (_v10_metadata(nil=True), 10),
    (_v10_metadata(nil=False), 10),
])
def test_version_is_read_from_the_keys(meta: dict, version: int) -> None:
    found = read_peer_version(_encode(meta))
    assert found is not None and found.version == version
    assert found.supported == (version != 12)


def test_v12_is_recognised_even_when_the_rest_would_not_decode() -> None:
    """The read is lenient: a v12 map whose other fields changed type still says 12."""
    meta = v12_metadata() | {"num_blocks": "sixteen", "block_lens": None}
    found = read_peer_version(_encode(meta))
    assert found is not None and found.version == 12


def test_unknown_keys_mean_an_unknown_version() -> None:
    found = read_peer_version(_encode(metadata_map() | {"region_tiles": [1, 2]}))
    assert found is not None and found.version is None and not found.supported
    assert "region_tiles" in found.evidence


@pytest.mark.parametrize("buf", [b"", b"\xc1", _encode([1, 2]), _encode({1: 2})])
def test_what_is_not_a_string_keyed_map_has_no_version(buf: bytes) -> None:
    assert read_peer_version(buf) is None


@pytest.mark.parametrize("kwargs", [
    {},
    {"local_hash": V11_HASH},
    {"local_hash": V11_HASH, "enforce_handshake_compat": False},
    {"local_hash": v12_hash()},
])
def test_v12_handshake_is_refused_naming_both_versions(kwargs: dict) -> None:
    """Whatever the hash says and whether it is enforced: the version is checked first."""
    with pytest.raises(ConnectorVersionError) as err:
        decode_handshake(v12_payload(), **kwargs)
    assert str(err.value).startswith(V12_MESSAGE)
    assert "region_members" in str(err.value)
    assert err.value.peer_version == 12 and err.value.local_version == 11
    assert isinstance(err.value, ProtocolError)
    assert not isinstance(err.value, HashMismatchError)


def test_unknown_version_handshake_is_refused() -> None:
    buf = payload(metadata_map() | {"region_tiles": [1, 2]}, 13)
    with pytest.raises(ConnectorVersionError,
                       match=r"^peer speaks a NIXL connector version kvbridge does not know; "
                             r"kvbridge \S+ speaks 11 \(supported: 10, 11\).*region_tiles"):
        decode_handshake(buf)


def test_v11_and_v10_keep_todays_behaviour() -> None:
    _, meta = decode_handshake(bytes.fromhex(V11["payload_msgpack_hex"]), local_hash=V11_HASH)
    assert meta.is_v11
    v10 = payload(_v10_metadata(nil=True), 10)
    with pytest.raises(HashMismatchError):  # §1.7: v10 is a hash mismatch when enforced ...
        decode_handshake(v10, local_hash=V11_HASH)
    _, meta = decode_handshake(v10, local_hash=V11_HASH, enforce_handshake_compat=False)
    assert not meta.is_v11  # ... and decodes with the fallbacks when it is not
