"""The model fingerprint (issue #35), on real files: which changes each mode sees, and that
two copies of one model agree wherever they lie and whenever they were written."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kvbridge_agent.cli import main
from kvbridge_agent.identity import fingerprint, model_files, sample_offsets
from kvbridge_agent.identity._fingerprint import EDGE, SAMPLE, WHOLE_BELOW

HEADER_PAD = 96 << 10   # a header longer than the first sampled chunk
DATA = 4 << 20


def safetensors(path: Path, *, names: tuple[str, ...] = ("a.weight", "b.weight"),
                data_bytes: int = DATA, seed: int = 0, pad: int = HEADER_PAD) -> Path:
    """A valid safetensors file: float32 tensors filling ``data_bytes``, and a header padded
    (``__metadata__``) to at least ``pad`` bytes."""
    each = data_bytes // len(names) // 4
    header: dict[str, object] = {
        n: {"dtype": "F32", "shape": [each], "data_offsets": [i * each * 4, (i + 1) * each * 4]}
        for i, n in enumerate(names)}
    header["__metadata__"] = {"pad": "x" * pad}
    raw = json.dumps(header).encode()
    data = np.random.default_rng(seed).standard_normal(each * len(names)).astype("<f4")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data.tobytes())
    return path


def header_len(path: Path) -> int:
    with path.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def model(root: Path) -> Path:
    safetensors(root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (root / "README.md").write_text("not part of the model")
    return root


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def sampled(path: Path) -> str:
    return fingerprint(path).value


def full(path: Path) -> str:
    return fingerprint(path, "full").value


def covered(size: int, offset: int) -> bool:
    return any(o <= offset < o + n for o, n in sample_offsets(size))


def test_scheme_and_shape_fit_the_crd(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    s, f = fingerprint(m), fingerprint(m, "full")
    assert s.value.startswith("sampled-v1:") and f.value.startswith("full-v1:")
    for fp in (s, f):
        assert len(fp.value) <= 75 and re.fullmatch(r"[a-z0-9:-]*", fp.value)
        assert re.fullmatch(r"[0-9a-f]{64}", fp.value.partition(":")[2])
        assert fp.files == 3   # README.md is not part of the model
    assert f.bytes_read == sum(p.stat().st_size for p in m.iterdir() if p.name != "README.md")
    assert s.bytes_read < f.bytes_read / 4


def test_same_model_elsewhere_later_same_fingerprint(tmp_path: Path) -> None:
    a = model(tmp_path / "node-a" / "models" / "m")
    b = tmp_path / "node-b" / "elsewhere"
    shutil.copytree(a, b)
    for p in b.iterdir():
        os.utime(p, (1_000_000, 1_000_000))
    (b / ".cache").mkdir()
    (b / ".cache" / "partial.safetensors").write_bytes(b"junk")
    (b / "LICENSE").write_text("other text")
    assert sampled(a) == sampled(b) and full(a) == full(b)
    assert [f.rel for f in model_files(b)] == ["config.json", "model.safetensors",
                                               "tokenizer.json"]


def test_a_byte_in_a_sampled_chunk_changes_it(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    before, size = sampled(m), (m / "model.safetensors").stat().st_size
    offset, _ = sample_offsets(size)[5]
    assert offset > header_len(m / "model.safetensors")
    flip(m / "model.safetensors", offset + 17)
    assert sampled(m) != before


def test_a_header_change_beyond_the_first_chunk_changes_it(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    st = m / "model.safetensors"
    before, size = sampled(m), st.stat().st_size
    offset = EDGE + SAMPLE + 1000    # inside the padded header, outside every sampled chunk
    assert offset < header_len(st) and not covered(size, offset)
    flip(st, offset)
    assert sampled(m) != before


def test_renamed_tensor_changes_it(tmp_path: Path) -> None:
    a = safetensors(tmp_path / "a" / "model.safetensors").parent
    b = safetensors(tmp_path / "b" / "model.safetensors", names=("a.weight", "c.weight")).parent
    assert sampled(a) != sampled(b)


def test_a_size_change_changes_it(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    before = sampled(m)
    st = m / "model.safetensors"
    os.truncate(st, st.stat().st_size + 4)
    assert sampled(m) != before


def test_small_files_are_hashed_whole(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    before = sampled(m)
    (m / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 0}}}))
    assert sampled(m) != before


def test_added_or_renamed_file_changes_it(tmp_path: Path) -> None:
    m = model(tmp_path / "m")
    before = sampled(m)
    (m / "config.json").rename(m / "config2.json")
    renamed = sampled(m)
    (m / "sub").mkdir()
    (m / "sub" / "adapter_config.json").write_text("{}")
    assert len({before, renamed, sampled(m)}) == 3


def test_an_unsampled_byte_escapes_sampled_but_not_full(tmp_path: Path) -> None:
    """The documented limit of sampled-v1: a patch to bytes no chunk reads, with sizes and
    headers unchanged, keeps its value; full-v1 sees it."""
    m = model(tmp_path / "m")
    st = m / "model.safetensors"
    s0, f0, size = sampled(m), full(m), st.stat().st_size
    offset = (sample_offsets(size)[3][0] + sample_offsets(size)[4][0]) // 2
    assert offset > header_len(st) and not covered(size, offset)
    flip(st, offset)
    assert sampled(m) == s0
    assert full(m) != f0


def test_sample_offsets_cover_ends_and_stay_inside(tmp_path: Path) -> None:
    assert sample_offsets(100) == [(0, 100)]
    for size in (WHOLE_BELOW, WHOLE_BELOW + 1, 16 << 30):
        ranges = sample_offsets(size)
        assert ranges[0] == (0, EDGE) and ranges[-1] == (size - EDGE, EDGE)
        assert all(o >= 0 and o + n <= size for o, n in ranges) and len(ranges) == 18


def test_sparse_and_symlinked_files(tmp_path: Path) -> None:
    """A Hugging Face snapshot is a directory of links into blobs/: the link's name counts,
    the target's bytes are read."""
    blobs = tmp_path / "blobs"
    safetensors(blobs / "x1", data_bytes=1 << 20)
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "model.safetensors").symlink_to(blobs / "x1")
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(blobs / "x1", plain / "model.safetensors")
    assert sampled(snap) == sampled(plain) and full(snap) == full(plain)


def test_unknown_mode_and_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sampled"):
        fingerprint(tmp_path, "md5")
    with pytest.raises(NotADirectoryError):
        fingerprint(tmp_path / "nope")


def test_cli_prints_fingerprint_and_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:  # fmt: skip
    m = model(tmp_path / "m")
    assert main(["fingerprint", str(m)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == sampled(m) and out[1].startswith("files: 3  bytes read: ")
    assert main(["fingerprint", str(m), "--full"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == full(m)
    assert main(["fingerprint", str(tmp_path / "empty-or-missing")]) == 2
