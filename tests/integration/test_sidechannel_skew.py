"""Version skew over a real side channel: a server on 127.0.0.1 answers with what vLLM main
(NIXL connector version 12) sends; ``kvbridge probe`` (the console script, as a subprocess)
and the agent's peer loading both refuse it naming both versions, never a hash mismatch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge_agent import __version__
from kvbridge_agent.geometry import CacheView
from kvbridge_agent.service import (
    AgentService,
    AgentSettings,
    EngineInfo,
    HandshakeOutcome,
    PeerRef,
)
from kvbridge_agent.sidechannel import SideChannelServer
from skew_payloads import V11, metadata_map, payload, v12_payload

KVBRIDGE = str(Path(sys.executable).parent / "kvbridge")
LOOPBACK = "127.0.0.1"
V11_HASH = V11["payload_compatibility_hash"]
NAMED = (f"peer speaks NIXL connector version 12; kvbridge {__version__} speaks 11 "
         "(supported: 10, 11)")


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVBRIDGE, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def v12_server() -> Iterator[SideChannelServer]:
    with SideChannelServer({(0, 0): v12_payload()}, host=LOOPBACK, port=0) as srv:
        yield srv


@pytest.mark.parametrize("extra", [[], ["--expect-hash", V11_HASH], ["--json"]])
def test_probe_refuses_v12_naming_both_versions(v12_server: SideChannelServer,
                                                extra: list[str]) -> None:
    out = probe("probe", f"{LOOPBACK}:{v12_server.port}", *extra)
    assert out.returncode == 4, (out.stdout, out.stderr)  # undecodable/mismatching handshake
    assert out.stdout == ""
    assert out.stderr.startswith(f"kvbridge probe: {NAMED}")
    assert "region_members" in out.stderr and "hash mismatch" not in out.stderr


def test_probe_refuses_an_unknown_version() -> None:
    newer = payload(metadata_map() | {"region_tiles": [[0], [1]]}, 13)
    with SideChannelServer({(0, 0): newer}, host=LOOPBACK, port=0) as srv:
        out = probe("probe", f"{LOOPBACK}:{srv.port}")
    assert out.returncode == 4
    assert out.stderr.startswith("kvbridge probe: peer speaks a NIXL connector version "
                                 f"kvbridge does not know; kvbridge {__version__} speaks 11 "
                                 "(supported: 10, 11)")
    assert "region_tiles" in out.stderr


#: The decode agent's KV memory (its views point here); nothing is registered with NIXL.
BUFFERS = [np.zeros(16 * 1152, np.uint8) for _ in range(2)]


def _decode_agent(enforce_hash: bool) -> AgentService:
    """A decode agent of the vector's shape, not started: refusing happens before anything
    touches NIXL, so only its side-channel client is opened (start() would load NIXL)."""
    views = [CacheView.from_range(f"model.layers.{i}.attn", b.ctypes.data, b.nbytes,
                                  group_id=0, num_blocks=16, block_len=1152, mem_type="VRAM",
                                  is_mla=True)
             for i, b in enumerate(BUFFERS)]
    svc = AgentService(views, EngineInfo("decode-9", "decode", is_mla=True), V11_HASH,
                       AgentSettings(handshake_timeout_s=5.0, enforce_hash=enforce_hash))
    svc._peers.open()
    return svc


@pytest.mark.parametrize("enforce_hash", [True, False])
def test_agent_peer_loading_refuses_v12(v12_server: SideChannelServer,
                                        enforce_hash: bool) -> None:
    """With the hash check on, the answer used to be a bare hash mismatch; with it off, the
    v12 metadata went on to validation as if it were 11. Either way it is refused by version."""
    svc = _decode_agent(enforce_hash)
    try:
        ref = PeerRef("p12-0", "decode-0", LOOPBACK, v12_server.port, 0, 1, None, "prefill")
        (report,) = svc.set_peers([ref])
        assert not report.ok and report.reason == HandshakeOutcome.INCOMPATIBLE
        assert report.message.startswith(f"ConnectorVersionError: {NAMED}")
        assert "hash mismatch" not in report.message
        assert not svc.peers()
    finally:
        svc._peers.close_client()
