"""Compatibility hash, spec §1.5, against vectors/v11-handshake.json."""

from __future__ import annotations

import pytest

from kvbridge_agent.protocol import (
    NIXL_CONNECTOR_VERSION,
    CompatibilityFactors,
    HashMismatchError,
    check_compatibility,
    compatibility_hash,
)
from spec_vectors import load_vectors

HASHES = load_vectors("v11-handshake.json")["compatibility_hash"]
FACTOR_KEYS = {
    "vllm_version",
    "nixl_connector_version",
    "model",
    "dtype",
    "num_kv_heads",
    "head_size",
    "num_hidden_layers",
    "attn_backend_name",
    "cache_dtype",
    "is_hma_enabled",
    "speculative_config",
    "transfer_mode",
}


@pytest.mark.parametrize("vec", HASHES, ids=lambda v: v["factors"]["model"])
def test_hash_vectors(vec: dict) -> None:
    assert set(vec["factors"]) == FACTOR_KEYS
    assert compatibility_hash(vec["factors"]) == vec["sha256"]
    assert compatibility_hash(CompatibilityFactors(**vec["factors"])) == vec["sha256"]


def test_factors_dataclass_emits_exactly_vllms_keys() -> None:
    f = CompatibilityFactors(
        vllm_version="1.4.2",
        model="m",
        dtype="torch.bfloat16",
        num_kv_heads=1,
        head_size=576,
        num_hidden_layers=61,
        attn_backend_name="FLASHMLA",
    )
    assert set(f.as_dict()) == FACTOR_KEYS
    assert f.nixl_connector_version == NIXL_CONNECTOR_VERSION == 11


def test_every_factor_changes_the_hash() -> None:
    base = dict(HASHES[1]["factors"])
    seen = {compatibility_hash(base)}
    for key in sorted(FACTOR_KEYS):
        changed = dict(base, **{key: "other" if key != "nixl_connector_version" else 10})
        seen.add(compatibility_hash(changed))
    assert len(seen) == len(FACTOR_KEYS) + 1


def test_tuple_aux_layers_hash_like_json_list() -> None:
    vec = HASHES[1]
    spec = dict(vec["factors"]["speculative_config"], auxiliary_layer_ids=(2, 16, 29))
    f = CompatibilityFactors(**dict(vec["factors"], speculative_config=spec))
    assert compatibility_hash(f) == vec["sha256"]


def test_check_compatibility_enforced_and_not(caplog: pytest.LogCaptureFixture) -> None:
    assert check_compatibility("a" * 64, "a" * 64)
    with pytest.raises(HashMismatchError) as err:
        check_compatibility("a" * 64, "b" * 64)
    msg = str(err.value)
    assert msg.startswith(
        f"NIXL compatibility hash mismatch. Local: {'a' * 64}, Remote: {'b' * 64}."
    )
    assert "Prefill and decode instances have incompatible configurations" in msg
    assert '{"kv_connector_extra_config": {"enforce_handshake_compat": false}}' in msg
    assert err.value.local_hash == "a" * 64 and err.value.remote_hash == "b" * 64
    with caplog.at_level("WARNING"):
        assert check_compatibility("a" * 64, "b" * 64, enforce=False) is False
    assert "mismatch ignored" in caplog.text
