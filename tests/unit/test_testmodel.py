"""``kvbridge write-test-model``: the tests' tiny Llama is the same bytes for the same seed,
its checkpoint is well-formed safetensors with the shapes vLLM's Llama loads, and its
tokenizer covers exactly the model's vocabulary. (tests/vllm_engines loads it with the real
safetensors, tokenizers and transformers packages.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kvbridge_agent import _testmodel as tm
from kvbridge_agent.cli import main


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    assert main(["write-test-model", str(tmp_path / "a"), "--seed", "9"]) == 0
    assert main(["write-test-model", str(tmp_path / "b"), "--seed", "9"]) == 0
    assert main(["write-test-model", str(tmp_path / "c"), "--seed", "10"]) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, c = (tmp_path / d / "model.safetensors" for d in "ac")
    assert a.read_bytes() != c.read_bytes() and a.stat().st_size == c.stat().st_size


def test_checkpoint_is_safetensors_with_llama_shapes(tmp_path: Path) -> None:
    tm.write_test_model(tmp_path, seed=3)
    raw = (tmp_path / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0
    header = json.loads(raw[8:8 + size])
    assert header.pop("__metadata__") == {"format": "pt"}
    expected = tm.weights(3)
    assert set(header) == set(expected)
    body, end = raw[8 + size:], 0
    for name in sorted(header):
        entry = header[name]
        begin, stop = entry["data_offsets"]
        assert begin == end and entry["dtype"] == "F32"
        array = np.frombuffer(body[begin:stop], dtype="<f4").reshape(entry["shape"])
        np.testing.assert_array_equal(array, expected[name])
        end = stop
    assert end == len(body)
    cfg = json.loads((tmp_path / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    assert header["model.embed_tokens.weight"]["shape"] == [cfg["vocab_size"], h]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert header[f"model.layers.{layers - 1}.self_attn.k_proj.weight"]["shape"] == [kv, h]
    assert f"model.layers.{layers}.self_attn.k_proj.weight" not in header


def test_tokenizer_covers_the_vocabulary_once() -> None:
    tok = tm.tokenizer_json(512)
    vocab = tok["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(512))
    assert [t["content"] for t in tok["added_tokens"]] == list(tm.SPECIAL_TOKENS)
    for merge in tok["model"]["merges"]:
        left, right = merge.split(" ")
        assert left in vocab and right in vocab and left + right in vocab
    with pytest.raises(ValueError, match="vocab_size"):
        tm.tokenizer_json(100)


def test_unwritable_directory_is_a_usage_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["write-test-model", str(blocker / "model")]) == 2
    assert "kvbridge write-test-model: cannot write" in capsys.readouterr().err
