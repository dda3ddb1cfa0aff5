"""The public surface of kvbridge_agent.protocol and .sidechannel is pinned, and the protocol
package stays pure (no ZMQ, NIXL, Kubernetes or numpy import)."""

from __future__ import annotations

import subprocess
import sys

import kvbridge_agent.protocol as protocol
import kvbridge_agent.sidechannel as sidechannel

PROTOCOL_API = {
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
    "check_metadata",
    "ValidationOptions",
    "Verdict",
    "check_compatibility",
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
}
SIDECHANNEL_API = {
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "HOST_ENV",
    "PORT_ENV",
    "ErrorReply",
    "HandshakeResult",
    "HandshakeTimeoutError",
    "RankReply",
    "RemoteRejectedError",
    "ReplyFormatError",
    "SideChannelClient",
    "SideChannelError",
    "SideChannelServer",
    "fetch_metadata",
    "side_channel_address",
    "tcp_endpoint",
}


def test_public_names_are_pinned() -> None:
    assert set(protocol.__all__) == PROTOCOL_API
    assert set(sidechannel.__all__) == SIDECHANNEL_API
    for mod in (protocol, sidechannel):
        assert all(hasattr(mod, name) for name in mod.__all__)


def test_error_families() -> None:
    for name in (
        "PayloadDecodeError",
        "MetadataDecodeError",
        "HashMismatchError",
        "EngineIdMismatchError",
        "RequestDecodeError",
        "TimestampDecodeError",
        "IncompatibleGeometryError",
    ):
        assert issubclass(getattr(protocol, name), protocol.ProtocolError)
    assert issubclass(protocol.ProtocolError, ValueError)
    assert issubclass(sidechannel.HandshakeTimeoutError, TimeoutError)
    assert issubclass(sidechannel.SideChannelError, RuntimeError)


def test_protocol_imports_nothing_impure() -> None:
    code = (
        "import sys, kvbridge_agent.protocol\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('zmq', 'nixl', 'nixl_cu12', 'kubernetes', 'kopf', 'torch', 'numpy'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
