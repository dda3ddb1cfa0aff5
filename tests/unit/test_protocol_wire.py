"""Wire format of the v11 handshake against spec §1.1-§1.3 and vectors/v11-handshake.json."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.protocol import (
    EngineIdMismatchError,
    HashMismatchError,
    MetadataDecodeError,
    NixlAgentMetadata,
    NixlHandshakePayload,
    PayloadDecodeError,
    ProtocolError,
    RequestDecodeError,
    TimestampDecodeError,
    decode_handshake,
    decode_metadata,
    decode_payload,
    decode_request,
    decode_timestamp,
    effective_regions,
    encode_metadata,
    encode_payload,
    encode_request,
    encode_timestamp,
    make_payload,
)
from spec_vectors import load_vectors

VECTORS = load_vectors("v11-handshake.json")
EXAMPLES = VECTORS["examples"]

# Spec §1.3, typed by hand (not derived from the code under test).
V11_FIELDS = [
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "device_id",
    "num_blocks",
    "block_lens",
    "block_strides",
    "kv_cache_layout",
    "block_size",
    "ssm_sizes",
    "attn_backend_name",
    "physical_blocks_per_logical_kv_block",
    "region_num_blocks",
    "region_group_ids",
    "region_names",
    "region_mem_types",
    "dcp_size",
    "pcp_size",
]
V11_NEW = ["region_num_blocks", "region_group_ids", "region_names", "region_mem_types"]


def meta_from_vector(raw: dict) -> NixlAgentMetadata:
    values = dict(raw)
    values["agent_metadata"] = bytes.fromhex(values["agent_metadata"])
    values["ssm_sizes"] = tuple(values["ssm_sizes"])
    return NixlAgentMetadata(**values)


class V10Metadata(msgspec.Struct, kw_only=True):
    """A version-10 peer: the v11 struct without the four per-region fields."""

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
    dcp_size: int = 1
    pcp_size: int = 1


def test_field_names_order_and_defaults_follow_spec() -> None:
    assert list(NixlAgentMetadata.__struct_fields__) == V11_FIELDS
    defaults = dict(
        zip(
            NixlAgentMetadata.__struct_fields__[-len(NixlAgentMetadata.__struct_defaults__) :],
            NixlAgentMetadata.__struct_defaults__,
            strict=True,
        )
    )
    assert defaults == {n: None for n in V11_NEW} | {"dcp_size": 1, "pcp_size": 1}
    assert list(NixlHandshakePayload.__struct_fields__) == [
        "compatibility_hash",
        "agent_metadata_bytes",
    ]


def test_vector_field_names_are_the_spec_names() -> None:
    for ex in EXAMPLES:
        assert list(ex["metadata"]) == V11_FIELDS


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: e["metadata"]["engine_id"])
def test_metadata_and_payload_bytes_equal_vectors(ex: dict) -> None:
    meta = meta_from_vector(ex["metadata"])
    assert encode_metadata(meta).hex() == ex["metadata_msgpack_hex"]
    payload = make_payload(meta, ex["payload_compatibility_hash"])
    assert encode_payload(payload).hex() == ex["payload_msgpack_hex"]


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: e["metadata"]["engine_id"])
def test_vector_bytes_decode_to_the_vector_values(ex: dict) -> None:
    payload, meta = decode_handshake(
        bytes.fromhex(ex["payload_msgpack_hex"]), local_hash=ex["payload_compatibility_hash"]
    )
    assert payload.compatibility_hash == ex["payload_compatibility_hash"]
    assert meta == meta_from_vector(ex["metadata"])
    assert decode_metadata(bytes.fromhex(ex["metadata_msgpack_hex"])) == meta
    assert encode_metadata(meta) == payload.agent_metadata_bytes


def test_map_keys_name_the_fields_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(bytes.fromhex(EXAMPLES[0]["metadata_msgpack_hex"]))
    assert isinstance(raw, dict)
    assert list(raw) == V11_FIELDS
    assert raw["region_group_ids"] == [0, -1]
    assert raw["agent_metadata"] == bytes.fromhex("00016e69786cfe")
    legacy = msgspec.msgpack.decode(bytes.fromhex(EXAMPLES[1]["metadata_msgpack_hex"]))
    assert all(legacy[n] is None for n in V11_NEW)


def test_request_frame_hex() -> None:
    assert encode_request(0, 1).hex() == VECTORS["request_pp0_tp1_hex"]
    assert decode_request(bytes.fromhex(VECTORS["request_pp0_tp1_hex"])) == (0, 1)
    assert decode_request(encode_request(3, 7)) == (3, 7)


@pytest.mark.parametrize(
    "obj",
    [
        [b"get_meta_msg", 0],
        [b"get_meta_msg", 0, 1, 2],
        ["get_meta_msg", 0, 1],
        [b"get_meta", 0, 1],
        [b"get_meta_msg", "0", 1],
        [b"get_meta_msg", 0.5, 1],
        {"get_meta_msg": 0},
        None,
    ],
)
def test_malformed_requests_raise_request_decode_error(obj: object) -> None:
    with pytest.raises(RequestDecodeError):
        decode_request(msgspec.msgpack.encode(obj))


def test_timestamp_frame_is_float64() -> None:
    buf = encode_timestamp(12.5)
    assert buf[0] == 0xCB and len(buf) == 9
    assert decode_timestamp(buf) == 12.5
    for bad in (msgspec.msgpack.encode("x"), b"", b"\xc1", msgspec.msgpack.encode(float("nan"))):
        with pytest.raises(TimestampDecodeError):
            decode_timestamp(bad)


def test_decoding_ignores_unknown_keys_and_order_and_defaults_optionals() -> None:
    raw = msgspec.msgpack.decode(bytes.fromhex(EXAMPLES[0]["metadata_msgpack_hex"]))
    reordered = dict(reversed(list(raw.items())))
    reordered["region_members"] = [["a"], ["b"]]  # a v12 field
    del reordered["dcp_size"], reordered["pcp_size"], reordered["region_names"]
    meta = decode_metadata(msgspec.msgpack.encode(reordered))
    assert meta.dcp_size == 1 and meta.pcp_size == 1 and meta.region_names is None
    assert meta.region_group_ids == [0, -1]


def test_v10_blob_decodes_with_v11_fields_none_and_falls_back_to_uniform() -> None:
    v10 = V10Metadata(
        engine_id="p-old",
        agent_metadata=b"\x01",
        kv_caches_base_addr=[4096, 8192, 12288],
        device_id=0,
        num_blocks=40,
        block_lens=[64, 64, 64],
        block_strides=[64, 64, 64],
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASHMLA",
        physical_blocks_per_logical_kv_block=1,
    )
    meta = decode_metadata(msgspec.msgpack.encode(v10))
    assert [getattr(meta, n) for n in V11_NEW] == [None] * 4
    assert not meta.is_v11
    eff = effective_regions(meta, local_region_group_ids=[0, 1, 1], local_mem_type="VRAM")
    assert eff.num_blocks == (40, 40, 40)
    assert eff.group_ids == (0, 1, 1)  # local ids, lengths match
    assert eff.mem_types == ("VRAM",) * 3
    assert eff.uses_group_mapping and not eff.mixed_mem_types
    eff = effective_regions(meta, local_region_group_ids=[0, 1], local_mem_type="DRAM")
    assert eff.group_ids == (0, 0, 0)  # lengths differ: [0] * R
    assert eff.mem_types == ("DRAM",) * 3
    assert not eff.uses_group_mapping


def test_v10_decoder_drops_the_v11_fields() -> None:
    buf = bytes.fromhex(EXAMPLES[0]["metadata_msgpack_hex"])
    old = msgspec.msgpack.decode(buf, type=V10Metadata)
    assert old.engine_id == "decode-0" and old.block_strides == [1152, 2304]
    assert not any(hasattr(old, n) for n in V11_NEW)
    # and a v11 blob's own arrays win over the fallback
    eff = effective_regions(decode_metadata(buf), local_region_group_ids=[5, 5])
    assert eff.num_blocks == (16, 8) and eff.group_ids == (0, -1)
    assert eff.mem_types == ("VRAM", "DRAM") and eff.mixed_mem_types


def test_two_phase_decode_checks_hash_before_inner_metadata() -> None:
    bad_inner = encode_payload(
        NixlHandshakePayload(compatibility_hash="a" * 64, agent_metadata_bytes=b"\xc1garbage")
    )
    with pytest.raises(HashMismatchError) as err:
        decode_handshake(bad_inner, local_hash="b" * 64)
    assert "NIXL compatibility hash mismatch. Local: " + "b" * 64 in str(err.value)
    assert "enforce_handshake_compat" in str(err.value)
    with pytest.raises(MetadataDecodeError, match=r"^Failed to decode NixlAgentMetadata"):
        decode_handshake(bad_inner, local_hash="b" * 64, enforce_handshake_compat=False)
    with pytest.raises(MetadataDecodeError):
        decode_handshake(bad_inner)  # no local hash: no check


@pytest.mark.parametrize("buf", [b"", b"\x00", b"\x92\x01\x02", msgspec.msgpack.encode({"a": 1})])
def test_payload_decode_error_message(buf: bytes) -> None:
    with pytest.raises(PayloadDecodeError, match=r"^Failed to decode NixlHandshakePayload") as e:
        decode_payload(buf)
    assert "incompatibility between connector versions" in str(e.value)
    assert isinstance(e.value, ProtocolError) and isinstance(e.value, ValueError)


def test_engine_id_mismatch() -> None:
    buf = bytes.fromhex(EXAMPLES[0]["payload_msgpack_hex"])
    with pytest.raises(EngineIdMismatchError, match="Remote NIXL agent engine ID mismatch"):
        decode_handshake(buf, expected_engine_id="prefill-7")
    _, meta = decode_handshake(buf, expected_engine_id="decode-0")
    assert meta.engine_id == "decode-0"


def test_wrong_types_are_metadata_decode_errors() -> None:
    raw = msgspec.msgpack.decode(bytes.fromhex(EXAMPLES[0]["metadata_msgpack_hex"]))
    for key, value in [
        ("num_blocks", "16"),
        ("agent_metadata", "str"),
        ("ssm_sizes", [0]),
        ("region_names", [1, 2]),
        ("block_lens", None),
    ]:
        broken = dict(raw, **{key: value})
        with pytest.raises(MetadataDecodeError, match=key):
            decode_metadata(msgspec.msgpack.encode(broken))
    missing = {k: v for k, v in raw.items() if k != "engine_id"}
    with pytest.raises(MetadataDecodeError, match="engine_id"):
        decode_metadata(msgspec.msgpack.encode(missing))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoders_raise_only_protocol_errors_on_random_bytes(buf: bytes) -> None:
    for decode in (decode_payload, decode_metadata, decode_request, decode_timestamp):
        with contextlib.suppress(ProtocolError):
            decode(buf)


@settings(max_examples=200, deadline=None)
@given(
    st.text(max_size=20),
    st.lists(st.integers(0, 2**64 - 1), max_size=8),
    st.lists(st.integers(-1, 7), max_size=8),
    st.lists(st.sampled_from(["DRAM", "VRAM"]), max_size=8),
)
def test_round_trip(engine: str, addrs: list[int], groups: list[int], mems: list[str]) -> None:
    meta = NixlAgentMetadata(
        engine_id=engine,
        agent_metadata=engine.encode(),
        kv_caches_base_addr=addrs,
        device_id=1,
        num_blocks=len(addrs),
        block_lens=[1] * len(addrs),
        block_strides=[2] * len(addrs),
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="X",
        physical_blocks_per_logical_kv_block=1,
        region_group_ids=groups,
        region_mem_types=mems,
    )
    payload = make_payload(meta, "h" * 64)
    got_payload, got = decode_handshake(encode_payload(payload), local_hash="h" * 64)
    assert got == meta and got_payload == payload
