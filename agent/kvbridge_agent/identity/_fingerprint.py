"""A content fingerprint of a model directory, cheap enough to take at every engine start.

Two engines that load different numbers under one model name (a volume updated in place, a
new revision, a fine-tune written to the old path) compute the same compatibility hash, pair,
and answer with another model's KV. The fingerprint tells them apart; the operator pairs
only endpoints with equal ones.

Both modes digest the files :func:`~._files.model_files` selects, in the order of their
relative paths, each named by that path and its size: never the directory's own path, a
file's mtime, owner or inode, so two copies of one model on two nodes (or one copy mounted
at two paths) agree.

``sampled-v1`` (the default) reads about 200 KiB per file whatever its size: files under
:data:`WHOLE_BELOW` (configs, tokenizers, templates) whole; of larger ones the first and
last :data:`EDGE` bytes, :data:`SAMPLES` chunks of :data:`SAMPLE` bytes evenly spaced in
between, and for ``.safetensors`` the whole header (the 8-byte little-endian length and the
JSON naming every tensor's name, dtype, shape and offsets). It detects a file added,
removed, renamed or resized, any change to a small file or to a safetensors header (a tensor
renamed, reshaped, retyped or moved), and any change that touches a sampled byte, which
covers a re-quantization, a re-training or another checkpoint written in place (those
change nearly every byte). It misses a change confined to unsampled bytes that leaves every
size and header as they were: a patch to a few weights, say. Use ``full-v1`` where that
matters.

``full-v1`` digests every byte of every file (sha256, in :data:`READ_CHUNK` reads, files
in parallel), so it detects any change, and costs a read of the whole model at start-up
(the page cache makes the ranks after the first cheap).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ._files import ModelFile, model_files

__all__ = [
    "EDGE",
    "MODES",
    "READ_CHUNK",
    "SAMPLE",
    "SAMPLES",
    "WHOLE_BELOW",
    "Fingerprint",
    "fingerprint",
    "sample_offsets",
]

#: Files smaller than this are hashed whole.
WHOLE_BELOW = 1 << 20
#: Bytes hashed at each end of a larger file.
EDGE = 64 << 10
#: Evenly spaced chunks hashed between the two ends, and their length.
SAMPLES, SAMPLE = 16, 4 << 10
#: The largest safetensors header taken whole (the format caps it at 100 MB).
HEADER_MAX = 100_000_000
#: Read size of the full mode.
READ_CHUNK = 8 << 20

#: Mode -> the versioned scheme its value starts with.
MODES = {"sampled": "sampled-v1", "full": "full-v1"}


@dataclass(frozen=True)
class Fingerprint:
    """A fingerprint and what taking it cost.

    Attributes:
        value: ``"<scheme>:<sha256 hex>"``, as ``spec.model.fingerprint`` carries it.
        files: how many files it covers.
        bytes_read: bytes read from them.
        seconds: wall time taken.
    """

    value: str
    files: int
    bytes_read: int
    seconds: float

    @property
    def scheme(self) -> str:
        return self.value.partition(":")[0]


def sample_offsets(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the ranges the sampled mode reads of a file of ``size``
    bytes (no header): all of it below :data:`WHOLE_BELOW`, else the two ends and the
    evenly spaced chunks. Depends on the size alone, so equal files are read alike."""
    if size < WHOLE_BELOW:
        return [(0, size)]
    span = size - 2 * EDGE - SAMPLE
    inner = [(EDGE + i * span // (SAMPLES - 1), SAMPLE) for i in range(SAMPLES)]
    return [(0, EDGE), *inner, (size - EDGE, EDGE)]


def _safetensors_header(fd: int, size: int) -> bytes:
    """The length prefix and JSON header of a safetensors file; just the prefix where it
    does not hold a plausible length (the sampled chunks still cover the file)."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        return prefix
    (length,) = struct.unpack("<Q", prefix)
    if length > HEADER_MAX or 8 + length > size:
        return prefix
    return prefix + os.pread(fd, length, 8)


def _read_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:   # short reads (network filesystems): go on where it stopped
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(f"file shrank while being read (at {offset + len(data)})")
        data += more
    return data


def _file_head(f: ModelFile, scheme: str) -> hashlib._Hash:
    h = hashlib.sha256()
    h.update(f"{scheme}\0{f.rel}\0{f.size}\0".encode())
    return h


def _sampled(f: ModelFile) -> tuple[bytes, int]:
    h, read = _file_head(f, MODES["sampled"]), 0
    fd = os.open(f.path, os.O_RDONLY)
    try:
        if f.rel.lower().endswith(".safetensors") and f.size >= WHOLE_BELOW:
            header = _safetensors_header(fd, f.size)
            h.update(b"H%d\0" % len(header))
            h.update(header)
            read += len(header)
        for offset, length in sample_offsets(f.size):
            chunk = _read_exact(fd, length, offset)
            h.update(b"C%d:%d\0" % (offset, length))
            h.update(chunk)
            read += length
    finally:
        os.close(fd)
    return h.digest(), read


def _full(f: ModelFile) -> tuple[bytes, int]:
    h, read = _file_head(f, MODES["full"]), 0
    buf = bytearray(min(READ_CHUNK, max(f.size, 1)))
    view = memoryview(buf)
    with open(f.path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])   # hashlib drops the GIL for large updates: files overlap
            read += n
    if read != f.size:
        raise OSError(f"{f.rel}: read {read} bytes of {f.size} (changed while read?)")
    return h.digest(), read


def _combine(scheme: str, files: list[ModelFile], digests: Iterable[tuple[bytes, int]]
             ) -> tuple[str, int]:  # fmt: skip
    top = hashlib.sha256(f"kvbridge-model\0{scheme}\0{len(files)}\0".encode())
    total = 0
    for digest, read in digests:
        top.update(digest)
        total += read
    return f"{scheme}:{top.hexdigest()}", total


def fingerprint(directory: str | os.PathLike[str], mode: str = "sampled", *,
                threads: int | None = None) -> Fingerprint:
    """The fingerprint of the model in ``directory`` (module docstring).

    Args:
        mode: ``"sampled"`` or ``"full"``.
        threads: files read at once in full mode (default: up to 4, by CPU count); the
            sampled mode reads too little to gain from more than one.

    Raises:
        ValueError: an unknown mode.
        OSError: the directory or a file cannot be read.
    """
    if mode not in MODES:
        raise ValueError(f"fingerprint mode {mode!r}: expected one of {sorted(MODES)}")
    start = time.perf_counter()
    files = model_files(directory)
    scheme = MODES[mode]
    one: Callable[[ModelFile], tuple[bytes, int]] = _sampled if mode == "sampled" else _full
    workers = 1 if mode == "sampled" else (threads or min(4, os.cpu_count() or 1))
    if workers > 1 and len(files) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-fingerprint") as pool:
            value, total = _combine(scheme, files, pool.map(one, files))
    else:
        value, total = _combine(scheme, files, map(one, files))
    return Fingerprint(value, len(files), total, time.perf_counter() - start)

