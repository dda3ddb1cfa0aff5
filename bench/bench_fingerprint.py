"""What the model fingerprint (``kvbridge_agent.identity``) costs an engine's start-up.

Two model directories, made in a temporary directory and removed after:

- ``tiny``: the tests' model (``kvbridge write-test-model``: 2-layer Llama, float32, 5 files,
  about 1.7 MB);
- ``16g``: four 4 GiB safetensors files, each a valid header (the tensor names, dtypes,
  shapes and offsets of a 4 GiB shard) extended with ``os.truncate``: sparse, so the reads
  cost the page cache and the hash, no disk. On a real disk or network volume, full mode is
  bounded by its read bandwidth instead, and sampled mode pays about 20 small reads per file.

JSON lines (lower is better):

- ``fingerprint.stat_walk.<model>``: the walk and ``os.stat`` of the same files alone, the
  floor any start-up check pays (ms; no baseline: ratio 1);
- ``fingerprint.sampled.<model>``: sampled-v1 (ms), against the full mode (ratio = sampled /
  full), with the stat walk's ratio in ``vs_stat_walk``;
- ``fingerprint.full.<model>``: full-v1 (ms), against the stat walk, with its throughput.

The full mode of ``16g`` is timed once (it reads 16 GiB); the rest is the best of rounds.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

from _common import best_time, emit
from kvbridge_agent._testmodel import write_test_model
from kvbridge_agent.identity import Fingerprint, fingerprint, model_files

GIB = 1 << 30


def sparse_shard(path: Path, size: int, index: int) -> None:
    """A safetensors shard of ``size`` bytes: bf16 tensors named and placed as in a
    Llama-style checkpoint, the data a hole."""
    tensors: dict[str, object] = {}
    offset, layer = 0, 0
    budget = size - (1 << 20)    # room for the header
    while True:
        for name, shape in (("self_attn.qkv_proj.weight", [6144, 4096]),
                            ("self_attn.o_proj.weight", [4096, 4096]),
                            ("mlp.gate_up_proj.weight", [28672, 4096]),
                            ("mlp.down_proj.weight", [4096, 14336])):
            n = shape[0] * shape[1] * 2
            if offset + n > budget:
                break
            tensors[f"model.layers.{index * 100 + layer}.{name}"] = {
                "dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        else:
            layer += 1
            continue
        break
    header = json.dumps(tensors).encode()
    header += b" " * (-(8 + len(header)) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    os.truncate(path, size)


def stat_walk(directory: Path) -> int:
    return sum(os.stat(f.path).st_size for f in model_files(directory))


def measure(tag: str, directory: Path, *, full_once: bool) -> None:
    walk_s = best_time(lambda: stat_walk(directory))
    sampled_s = best_time(lambda: fingerprint(directory, "sampled"))
    sampled: Fingerprint = fingerprint(directory, "sampled")
    if full_once:
        fingerprint(directory, "sampled")
        start = time.perf_counter()
        full = fingerprint(directory, "full")
        full_s = time.perf_counter() - start
    else:
        full_s = best_time(lambda: fingerprint(directory, "full"), min_time=0.5)
        full = fingerprint(directory, "full")
    total = stat_walk(directory)
    emit(f"fingerprint.stat_walk.{tag}", walk_s * 1e3, "ms", "none", 1.0,
         files=sampled.files, bytes=total)
    emit(f"fingerprint.sampled.{tag}", sampled_s * 1e3, "ms", f"fingerprint.full.{tag}",
         sampled_s / full_s, vs_stat_walk=round(sampled_s / walk_s, 2),
         bytes_read=sampled.bytes_read, files=sampled.files, bytes=total)
    emit(f"fingerprint.full.{tag}", full_s * 1e3, "ms", f"fingerprint.stat_walk.{tag}",
         full_s / walk_s, bytes_read=full.bytes_read, files=full.files,
         gib_per_s=round(full.bytes_read / GIB / full_s, 2), timed_once=full_once)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-fingerprint-") as tmp:
        root = Path(tmp)
        tiny = write_test_model(root / "tiny")
        measure("tiny", tiny, full_once=False)
        big = root / "16g"
        big.mkdir()
        for i in range(4):
            sparse_shard(big / f"model-{i + 1:05d}-of-00004.safetensors", 4 * GIB, i)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"):
            (big / name).write_bytes((tiny / name).read_bytes())
        measure("16g", big, full_once=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
