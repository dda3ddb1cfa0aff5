"""Which NIXL connector version a peer speaks, read before anything strict (spec §1.4, §1.7).

The handshake carries no version number: vLLM hashes ``nixl_connector_version`` into the
compatibility hash, which cannot be read back. What the wire does show is the set of keys
in the metadata map, and every version that changed the schema added one. So the version is
read from the keys, leniently (any map decodes), before the hash check and the strict
decode; a peer that speaks another version is then refused with both versions named instead
of a bare hash mismatch, a decode error or, with the hash check off, a silent misreading.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from .. import __version__
from ..rules import NIXL_CONNECTOR_VERSION
from ._errors import ConnectorVersionError

#: The versions kvbridge accepts from a peer: its own, and 10, decoded with the per-region
#: fallbacks of spec §1.6 (the hash check keeps refusing 10 unless it is turned off, §1.7).
SUPPORTED_CONNECTOR_VERSIONS: tuple[int, ...] = (10, NIXL_CONNECTOR_VERSION)

#: Keys added by version 11; a v10 peer sends none of them (or nil).
V11_KEYS = frozenset({"region_num_blocks", "region_group_ids", "region_names",
                      "region_mem_types"})
#: Keys of every version up to 10 that kvbridge knows of (spec §1.3 rows without "v11").
_V10_KEYS = frozenset({
    "engine_id", "agent_metadata", "kv_caches_base_addr", "device_id", "num_blocks",
    "block_lens", "block_strides", "kv_cache_layout", "block_size", "ssm_sizes",
    "attn_backend_name", "physical_blocks_per_logical_kv_block", "dcp_size", "pcp_size"})
#: Key added by version 12 (vLLM main): the layer names folded into each region.
V12_KEYS = frozenset({"region_members"})
_KNOWN_KEYS = _V10_KEYS | V11_KEYS | V12_KEYS

_KEYS_DECODER = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True)
class PeerVersion:
    """A peer's connector version as its metadata keys show it.

    ``version`` is None when the keys match no version kvbridge knows; ``evidence`` says
    which keys decided, for the refusal message.
    """

    version: int | None
    evidence: str

    @property
    def supported(self) -> bool:
        return self.version in SUPPORTED_CONNECTOR_VERSIONS


def read_peer_version(metadata_bytes: bytes | memoryview) -> PeerVersion | None:
    """The connector version of an encoded ``NixlAgentMetadata``; None when the bytes are
    not a msgpack map with string keys (the strict decode then reports what is wrong)."""
    try:
        fields = _KEYS_DECODER.decode(metadata_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    keys = set(fields)
    unknown = sorted(keys - _KNOWN_KEYS)
    if unknown:
        return PeerVersion(None, f"its metadata has field(s) {', '.join(unknown)} that no "
                                 "version up to 12 has: a newer version")
    if keys & V12_KEYS:
        return PeerVersion(12, "its metadata has region_members, added in version 12")
    present = {k for k in V11_KEYS & keys if fields[k] != msgspec.Raw(b"\xc0")}
    if present:
        return PeerVersion(NIXL_CONNECTOR_VERSION, "its metadata has the per-region fields")
    return PeerVersion(10, "its metadata has none of the per-region fields of version 11")


def check_peer_version(metadata_bytes: bytes | memoryview) -> PeerVersion | None:
    """Raise :class:`ConnectorVersionError` when the peer speaks an unsupported version."""
    found = read_peer_version(metadata_bytes)
    if found is not None and not found.supported:
        raise ConnectorVersionError(found.version, found.evidence, local_release=__version__,
                                    local_version=NIXL_CONNECTOR_VERSION,
                                    supported=SUPPORTED_CONNECTOR_VERSIONS)
    return found
