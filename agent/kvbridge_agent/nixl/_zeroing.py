"""Zeroing of local byte ranges by memory kind: the one place that writes zeros (spec §4.9).

:func:`zero_ranges` takes the rows ``geometry.untransferred_ranges`` returns for one NIXL
memory type, ``(addr, nbytes, device_id)`` uint64, and zeroes them:

- ``"DRAM"``: ``ctypes.memset`` per range, synchronous.
- ``"VRAM"``: torch, imported lazily (CPU deployments never need it): each range becomes a
  uint8 tensor aliasing the device memory (``__cuda_array_interface__``, checked to alias,
  never a copy) and is zeroed on the current stream of its device. The kernels are queued,
  not waited for: work the engine's user queues on that stream afterwards (the model's
  forward pass) is ordered after them, exactly like vLLM's ``_zero_region_blocks``.

The caller must only zero once no DMA can write the ranges any more (every part of the
request DONE); after a failure nothing is zeroed (spec §4.8).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["zero_ranges"]


def zero_ranges(rows: np.ndarray, nixl_type: str) -> int:
    """Zero every ``(addr, nbytes, device_id)`` row of ``rows`` in ``nixl_type`` memory.

    Returns the number of bytes zeroed. Raises ValueError for an unknown memory type or a
    malformed table, RuntimeError when VRAM zeroing is impossible (no CUDA torch, or torch
    would not alias the range).
    """
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(f"expected (N, 3) rows of (addr, nbytes, device_id), got {rows.shape}")
    if rows.shape[0] == 0:
        return 0
    triples = rows.astype(np.uint64).tolist()
    if nixl_type == "DRAM":
        for addr, nbytes, _dev in triples:
            ctypes.memset(addr, 0, nbytes)
    elif nixl_type == "VRAM":
        _zero_vram(triples)
    else:
        raise ValueError(f"cannot zero memory of NIXL type {nixl_type!r} (DRAM or VRAM)")
    return int(sum(t[1] for t in triples))


class _DeviceRange:
    """A raw device byte range exposed to torch through the CUDA array interface (v2)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "strides": None,
            "version": 2,
        }


def _zero_vram(triples: list[list[int]]) -> None:
    torch: Any
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - production images ship torch
        raise RuntimeError("zeroing VRAM needs torch with CUDA, which is not installed") from exc
    if not torch.cuda.is_available():
        raise RuntimeError("zeroing VRAM needs a CUDA device, torch sees none")
    for addr, nbytes, dev in triples:
        with torch.cuda.device(int(dev)):
            t = torch.as_tensor(_DeviceRange(addr, nbytes))
            if (t.data_ptr() != addr or t.device.type != "cuda" or t.device.index != int(dev)
                    or t.numel() != nbytes):
                raise RuntimeError(
                    f"torch did not alias device range {addr:#x}+{nbytes} (got a tensor at "
                    f"{t.data_ptr():#x} on {t.device}); refusing to zero a copy"
                )
            t.zero_()
