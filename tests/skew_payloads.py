"""Handshake payloads of peers that speak another NIXL connector version than kvbridge (11).

Built from the v11 acceptance vector so that only what the other version changes differs:
a version-12 peer (vLLM main) adds ``region_members`` (the layer names folded into each
region) after ``pcp_size`` and hashes ``nixl_connector_version: 12``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge_agent.protocol import compatibility_hash
from spec_vectors import load_vectors

VECTORS = load_vectors("v11-handshake.json")
V11 = VECTORS["examples"][0]
V11_FACTORS: dict[str, Any] = VECTORS["compatibility_hash"][0]["factors"]


def metadata_map(example: dict[str, Any] = V11) -> dict[str, Any]:
    """The example's metadata as the plain map that is on the wire (field order kept)."""
    return msgspec.msgpack.decode(bytes.fromhex(example["metadata_msgpack_hex"]))


def payload(meta: dict[str, Any], version: int) -> bytes:
    """An outer payload around ``meta`` whose hash says ``version`` (vector factors)."""
    factors = {**V11_FACTORS, "nixl_connector_version": version}
    return msgspec.msgpack.encode({
        "compatibility_hash": compatibility_hash(factors),
        "agent_metadata_bytes": msgspec.msgpack.encode(meta),
    })


def v12_metadata() -> dict[str, Any]:
    """What vLLM main (``NIXL_CONNECTOR_VERSION = 12``) sends for the vector's engine."""
    meta = metadata_map()
    meta["region_members"] = [[name] for name in meta["region_names"]]
    return meta


def v12_payload() -> bytes:
    return payload(v12_metadata(), 12)


def v12_hash() -> str:
    return compatibility_hash({**V11_FACTORS, "nixl_connector_version": 12})
