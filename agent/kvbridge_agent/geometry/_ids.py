"""Shared helpers: block-id lists as int64 arrays, and region labels for messages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import GeometryError


def empty_ids() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


_I64 = np.dtype(np.int64)


def as_ids(entry, where: str, index: int | None = None) -> np.ndarray:
    """One block-id list as a 1-D int64 array (no copy when it already is one)."""
    if type(entry) is np.ndarray and entry.dtype is _I64 and entry.ndim == 1:
        return entry
    a = entry if isinstance(entry, np.ndarray) else np.asarray(entry)
    if a.dtype == np.int64 and a.ndim == 1:
        return a
    if a.size == 0:
        return empty_ids()
    label = where if index is None else f"{where}[{index}]"
    if a.ndim != 1:
        raise GeometryError(f"{label}: expected a flat list of block ids, got shape {a.shape}")
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        raise GeometryError(f"{label}: block ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def as_id_lists(block_ids, where: str) -> list[np.ndarray]:
    """A per-group (or per-region) sequence of block-id lists as int64 arrays."""
    if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1 and block_ids.size:
        raise GeometryError(
            f"{where}: expected one block-id list per group/region, got a flat array; "
            "wrap it in a list for a single group"
        )
    return [as_ids(e, where, i) for i, e in enumerate(block_ids)]


def region_label(r: int, names: Sequence[str] | None) -> str:
    if names is not None and 0 <= r < len(names):
        return f"region {r} ({names[r]!r})"
    return f"region {r}"
