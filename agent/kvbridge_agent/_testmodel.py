"""A tiny Llama checkpoint with seeded random weights and a byte-level tokenizer, for tests
and the demo on machines that cannot download weights.

It exists so that a P/D transfer can be judged by its tokens: with random float32 weights
every prompt position matters, so a decode that received wrong or zeroed KV gives different
greedy tokens (vLLM's ``load_format="dummy"`` does not: its tokens depend on the last prompt
token only). The same seed writes the same bytes on every machine, so prefill and decode pods
that each write their own copy serve one model. It is not a language model; real pods mount
their model as usual.

Pure numpy and JSON: no torch, safetensors or tokenizers package is needed to write it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

#: Shapes of the engine tests' tiny Llama (tests/vllm_engines): 2 layers, GQA 4/2, head 32.
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
#: Letters whose pairs fill the vocabulary after the specials and the 256 bytes.
MERGE_LETTERS = "etaoinsrhldcumfpgwybvkxjqz"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEIGHT_STD = 0.08


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """A byte-level BPE over exactly ``vocab_size`` ids: specials, 256 bytes, letter pairs.

    Every id the model can emit decodes to text, and every text encodes.
    """
    pieces = [*SPECIAL_TOKENS, *_byte_alphabet()]
    merges: list[str] = []
    for a in MERGE_LETTERS:
        for b in MERGE_LETTERS:
            if len(pieces) == vocab_size:
                break
            pieces.append(a + b)
            merges.append(f"{a} {b}")
    if len(pieces) != vocab_size:
        raise ValueError(f"vocab_size: expected {len(SPECIAL_TOKENS) + 256} to "
                         f"{len(SPECIAL_TOKENS) + 256 + len(MERGE_LETTERS) ** 2}, "
                         f"got {vocab_size}")  # fmt: skip
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
            "byte_fallback": False, "ignore_merges": False,
            "vocab": {p: i for i, p in enumerate(pieces)}, "merges": merges,
        },
    }  # fmt: skip


def tokenizer_config() -> dict[str, Any]:
    unk, bos, eos = SPECIAL_TOKENS
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "unk_token": unk, "model_max_length": CONFIG["max_position_embeddings"],
            "add_bos_token": False, "chat_template": CHAT_TEMPLATE}  # fmt: skip


def weights(seed: int, config: dict[str, Any] = CONFIG) -> dict[str, np.ndarray]:
    """Checkpoint tensors by vLLM/transformers Llama name, drawn in a fixed order."""
    rng = np.random.default_rng(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD))

    def norm() -> np.ndarray:
        return np.float32(1.0) + rand(h)

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": norm(),
               "lm_head.weight": rand(v, h)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": norm(),
            f"{p}.post_attention_layernorm.weight": norm(),
            f"{p}.self_attn.q_proj.weight": rand(q_out, h),
            f"{p}.self_attn.k_proj.weight": rand(kv_out, h),
            f"{p}.self_attn.v_proj.weight": rand(kv_out, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q_out),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
        }
    return tensors


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """The safetensors file format for float32 arrays: u64 header length, JSON header
    (padded to 8 bytes), then the tensors' little-endian data in name order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(chunks)


def write_test_model(out: Path, seed: int = 0, config: dict[str, Any] = CONFIG) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``out``.

    ``config`` may change the layers (the engine tests' hybrid model interleaves
    sliding-window layers); the vocabulary stays the tokenizer's.

    Each file is written beside its final name and renamed into place, so a reader (a pod
    starting beside an init container that is still writing) never sees half a file.
    """
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps(config, indent=2).encode() + b"\n",
        "tokenizer.json": json.dumps(tokenizer_json(config["vocab_size"])).encode(),
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2).encode() + b"\n",
        "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}).encode(),
        "model.safetensors": safetensors_bytes(weights(seed, config)),
    }
    for name, data in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / name)
    return out
