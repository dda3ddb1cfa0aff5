"""`kvbridge probe` end to end: the installed console script as a subprocess against a real
side-channel server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge_agent.sidechannel import SideChannelServer
from spec_vectors import load_vectors

VECTORS = load_vectors("v11-handshake.json")
EXAMPLE = VECTORS["examples"][0]
PAYLOAD = bytes.fromhex(EXAMPLE["payload_msgpack_hex"])
HASH = EXAMPLE["payload_compatibility_hash"]
KVBRIDGE = str(Path(sys.executable).parent / "kvbridge")
LOOPBACK = "127.0.0.1"

# The local engine matching the vector's prefill side region for region (MLA, pure pull).
LOCAL = {
    "engine_id": "decode-9",
    "tp_size": 1,
    "block_size": 16,
    "num_blocks": 16,
    "kv_cache_layout": "HND",
    "attn_backend_name": "FLASH_ATTN",
    "is_mla": True,
    "compatibility_hash": HASH,
    "regions": [
        {
            "name": "model.layers.0.attn",
            "numBlocks": 16,
            "groupId": 0,
            "memType": "VRAM",
            "blockLen": 1152,
            "blockStride": 1152,
        },
        {
            "name": "model.layers.1.attn",
            "numBlocks": 8,
            "groupId": -1,
            "memType": "VRAM",
            "blockLen": 1152,
            "blockStride": 2304,
        },
    ],
}


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVBRIDGE, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def server() -> Iterator[SideChannelServer]:
    # The vector producer has a DRAM region: a mixed-memory producer.
    with SideChannelServer({(0, 0): PAYLOAD, (0, 1): PAYLOAD}, host=LOOPBACK, port=0) as srv:
        yield srv


def test_version() -> None:
    out = probe("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == "kvbridge 0.1.0 (NIXL connector version 11)"


def test_probe_json(server: SideChannelServer) -> None:
    out = probe(
        "probe",
        f"{LOOPBACK}:{server.port}",
        "--tp",
        "0-1",
        "--json",
        "--expect-hash",
        HASH,
        "--engine-id",
        "decode-0",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["endpoint"] == f"tcp://{LOOPBACK}:{server.port}"
    assert [(r["pp_rank"], r["tp_rank"]) for r in doc["ranks"]] == [(0, 0), (0, 1)]
    expected = dict(EXAMPLE["metadata"])  # spec names; bytes as hex, as in the vectors file
    for rank in doc["ranks"]:
        assert rank["metadata"] == expected
        assert rank["compatibility_hash"] == HASH
        assert rank["rtt_s"] > 0


def test_probe_human_summary(server: SideChannelServer) -> None:
    out = probe("probe", f"{LOOPBACK}:{server.port}")
    assert out.returncode == 0, out.stderr
    assert "engine 'decode-0'  v11" in out.stdout
    assert "model.layers.1.attn" in out.stdout and "DRAM" in out.stdout


def test_probe_compatible_and_incompatible_geometry(
    server: SideChannelServer, tmp_path: Path
) -> None:
    local_mixed = dict(
        LOCAL, regions=[dict(LOCAL["regions"][0]), dict(LOCAL["regions"][1], memType="DRAM")]
    )
    good = tmp_path / "good.json"
    good.write_text(json.dumps(local_mixed))
    # Same layout, but the producer is mixed-memory: pull rejects it (spec §1.6).
    out = probe("probe", f"{LOOPBACK}:{server.port}", "--geometry", str(good), "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    problems = doc["ranks"][0]["verdict"]["problems"]
    assert [p["rule"] for p in problems] == ["mixed_memory"]
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("kvbridge probe: incompatible: rank (pp 0, tp 0)")
    assert "NIXL pull does not yet support a mixed-memory producer" in out.stderr

    bad = dict(
        LOCAL,
        regions=[dict(LOCAL["regions"][0]), dict(LOCAL["regions"][1], name="model.layers.2.attn")],
    )
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    out = probe("probe", f"{LOOPBACK}:{server.port}", "--geometry", str(path))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert (
        "region_names[1]: local 'model.layers.2.attn' != remote 'model.layers.1.attn'" in out.stderr
    )
    assert "[region_names]" in out.stdout


def test_probe_compatible_geometry_exits_zero(tmp_path: Path) -> None:
    # A uniform-VRAM producer built from the vector, served on its own port.
    from kvbridge_agent.protocol import decode_handshake, encode_payload, make_payload

    _, meta = decode_handshake(PAYLOAD)
    meta.region_mem_types[1] = "VRAM"
    with SideChannelServer(
        {(0, 0): encode_payload(make_payload(meta, HASH))}, host=LOOPBACK, port=0
    ) as srv:
        path = tmp_path / "local.json"
        path.write_text(json.dumps(LOCAL))
        out = probe("probe", f"{LOOPBACK}:{srv.port}", "--geometry", str(path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ranks"][0]["verdict"] == {"ok": True, "problems": []}


def test_probe_closed_port_fails_with_reason() -> None:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    out = probe("probe", f"{LOOPBACK}:{port}", "--timeout", "0.5")
    assert out.returncode == 3
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"kvbridge probe: side channel tcp://{LOOPBACK}:{port}: no reply")
    assert "never connected" in out.stderr


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--expect-hash", "0" * 64], 4, "NIXL compatibility hash mismatch"),
        (["--engine-id", "other"], 4, "Remote NIXL agent engine ID mismatch"),
        (["--tp", "5"], 5, "unknown_rank"),
    ],
)
def test_probe_failures_are_one_line(
    server: SideChannelServer, args: list[str], code: int, text: str
) -> None:
    out = probe("probe", f"{LOOPBACK}:{server.port}", *args)
    assert out.returncode == code
    assert out.stderr.count("\n") == 1 and text in out.stderr


def test_probe_bad_geometry_file(server: SideChannelServer, tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"engine_id": "x", "blok_size": 16}))
    out = probe("probe", f"{LOOPBACK}:{server.port}", "--geometry", str(path))
    assert out.returncode == 2
    assert "unknown keys ['blok_size']" in out.stderr and out.stderr.count("\n") == 1


def _broken_payload() -> bytes:
    """The vector's metadata with a third memory type for its two regions and a stride that
    does not cover its block: decodable, but no engine could look like this."""
    import msgspec

    from kvbridge_agent.protocol import decode_metadata, encode_payload, make_payload

    meta = decode_metadata(bytes.fromhex(EXAMPLE["metadata_msgpack_hex"]))
    broken = msgspec.structs.replace(meta, region_mem_types=["VRAM", "DRAM", "VRAM"],
                                     block_strides=[1152, 1000])
    return encode_payload(make_payload(broken, HASH))


@pytest.fixture(scope="module")
def broken_server() -> Iterator[SideChannelServer]:
    with SideChannelServer({(0, 0): PAYLOAD, (0, 1): _broken_payload()}, host=LOOPBACK,
                           port=0) as srv:
        yield srv


def test_probe_reports_self_inconsistent_metadata_without_a_geometry(
    broken_server: SideChannelServer,
) -> None:
    target = f"{LOOPBACK}:{broken_server.port}"
    out = probe("probe", target, "--tp", "1")
    assert out.returncode == 4, out.stdout
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("kvbridge probe: broken metadata: rank (pp 0, tp 1)")
    assert "len(region_mem_types): expected 2 (one entry per region" in out.stderr
    assert "block_strides[1]: expected >= block_lens[1] (1152), got 1000" in out.stdout
    assert "metadata: BROKEN, 2 problem(s)" in out.stdout

    out = probe("probe", target, "--tp", "0-1", "--json")
    assert out.returncode == 4
    healthy, broken = json.loads(out.stdout)["ranks"]
    assert healthy["consistency"] == {"ok": True, "problems": []}
    assert not broken["consistency"]["ok"]
    assert {p["field"] for p in broken["consistency"]["problems"]} == {
        "len(region_mem_types)", "block_strides[1]"}
    assert "(pp 0, tp 1)" in out.stderr        # the healthy rank 0 is not blamed

    out = probe("probe", target, "--tp", "0")
    assert out.returncode == 0 and "metadata: consistent" in out.stdout
