"""CacheView: one named KV cache view as the serving engine hands it over (spec §2.1, §2.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import rules
from ..rules import MEM_TYPES
from ._errors import CacheViewError

__all__ = ["MEM_TYPES", "CacheView", "block_extent", "tensor_mem_type"]


def block_extent(num_blocks: int, block_stride: int, block_len: int) -> int:
    """Bytes from block 0's start to the end of the last block (0 without blocks)."""
    return (num_blocks - 1) * block_stride + block_len if num_blocks else 0


def tensor_mem_type(tensor: Any, mem_type: str | None = None) -> tuple[str, int]:
    """``(memory type, NIXL device id)`` of a tensor-like: ``"DRAM"`` on device 0 for a CPU
    tensor, else ``"VRAM"`` on its device index; ``mem_type`` overrides the type."""
    device = getattr(tensor, "device", None)
    if mem_type is None:
        mem_type = "DRAM" if getattr(device, "type", "cpu") == "cpu" else "VRAM"
    index = getattr(device, "index", None)
    return mem_type, 0 if mem_type == "DRAM" or index is None else max(int(index), 0)


def _check_int(name: str, field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheViewError(
            f"view {name!r}: {field} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise CacheViewError(f"view {name!r}: {field} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CacheView:
    """One KV cache view (per layer): where block 0 lives and how blocks are laid out.

    Descriptor ``b`` of the view covers ``[addr + b*block_stride, ... + block_len)``.
    ``reg_base``/``reg_nbytes`` give the memory range to register with NIXL (the untyped
    storage for ordinary views); by default the range covering exactly the view's blocks.
    Invalid fields raise :class:`CacheViewError` naming the layer and the field.
    """

    name: str
    group_id: int
    addr: int
    num_blocks: int
    block_len: int
    block_stride: int
    mem_type: str = "VRAM"
    device_id: int = 0
    reg_base: int | None = None
    reg_nbytes: int | None = None
    is_mla: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CacheViewError(f"view name must be a non-empty str, got {self.name!r}")
        n = self.name
        _check_int(n, "group_id", self.group_id, 0)
        _check_int(n, "addr", self.addr, 0)
        _check_int(n, "num_blocks", self.num_blocks, 0)
        _check_int(n, "block_len", self.block_len, 1)
        _check_int(n, "block_stride", self.block_stride, 1)
        _check_int(n, "device_id", self.device_id, 0)
        if bad := rules.block_stride(self.block_stride, self.block_len):
            raise CacheViewError(f"view {n!r}: {bad.message}")
        if bad := rules.mem_type(self.mem_type):
            raise CacheViewError(f"view {n!r}: {bad.message}")
        if self.addr + self.extent > 2**64:
            raise CacheViewError(f"view {n!r}: blocks extend past the 64-bit address space")
        if (self.reg_base is None) != (self.reg_nbytes is None):
            raise CacheViewError(
                f"view {n!r}: reg_base and reg_nbytes must be given together "
                f"(got reg_base={self.reg_base!r}, reg_nbytes={self.reg_nbytes!r})"
            )
        if self.reg_base is not None:
            _check_int(n, "reg_base", self.reg_base, 0)
            _check_int(n, "reg_nbytes", self.reg_nbytes, 1)
            assert self.reg_nbytes is not None
            if self.addr < self.reg_base or (
                self.addr + self.extent > self.reg_base + self.reg_nbytes
            ):
                raise CacheViewError(
                    f"view {n!r}: blocks [{self.addr:#x}, {self.addr + self.extent:#x}) "
                    f"fall outside the registration range [{self.reg_base:#x}, "
                    f"{self.reg_base + self.reg_nbytes:#x})"
                )

    @property
    def extent(self) -> int:
        """Bytes from ``addr`` to the end of the last block (0 for an empty view)."""
        return block_extent(self.num_blocks, self.block_stride, self.block_len)

    @property
    def registration(self) -> tuple[int, int]:
        """``(start, length)`` of the memory range to register for this view."""
        if self.reg_base is not None and self.reg_nbytes is not None:
            return self.reg_base, self.reg_nbytes
        return self.addr, self.extent

    @classmethod
    def from_range(
        cls,
        name: str,
        addr: int,
        nbytes: int,
        *,
        group_id: int,
        num_blocks: int,
        mem_type: str,
        device_id: int = 0,
        block_len: int | None = None,
        block_stride: int | None = None,
        is_mla: bool = True,
    ) -> CacheView:
        """A view over a raw memory range of ``nbytes`` at ``addr`` (registered whole).

        ``block_stride`` defaults to ``nbytes // num_blocks`` (which must divide exactly)
        and ``block_len`` to ``block_stride``.
        """
        if block_stride is None:
            if not isinstance(num_blocks, int) or num_blocks <= 0:
                raise CacheViewError(
                    f"view {name!r}: num_blocks must be > 0 to derive block_stride, "
                    f"got {num_blocks!r}"
                )
            if nbytes % num_blocks:
                raise CacheViewError(
                    f"view {name!r}: nbytes ({nbytes}) is not a multiple of num_blocks "
                    f"({num_blocks}); pass block_stride explicitly"
                )
            block_stride = nbytes // num_blocks
        if block_len is None:
            block_len = block_stride
        return cls(
            name=name,
            group_id=group_id,
            addr=addr,
            num_blocks=num_blocks,
            block_len=block_len,
            block_stride=block_stride,
            mem_type=mem_type,
            device_id=device_id,
            reg_base=addr,
            reg_nbytes=nbytes,
            is_mla=is_mla,
        )

    @classmethod
    def from_tensor(
        cls,
        name: str,
        tensor: Any,
        *,
        group_id: int,
        num_blocks: int | None = None,
        block_len: int | None = None,
        is_mla: bool = True,
        mem_type: str | None = None,
        block_stride: int | None = None,
        ppl: int = 1,
    ) -> CacheView:
        """A view from a blocks-first tensor (duck-typed: torch is never imported).

        Uses ``data_ptr()``, ``shape``, ``stride()``, ``element_size()``, ``device`` and,
        when present, ``untyped_storage()`` for the registration range. Defaults:
        ``num_blocks = shape[0]``, ``block_stride = stride(0) * element_size()``,
        ``block_len`` = bytes of one block's content (``prod(shape[1:]) * element_size``).
        A 1-D view is treated as a flat pool: ``num_blocks`` is then required and each
        block is ``nbytes // num_blocks`` bytes. ``mem_type`` defaults to ``"DRAM"`` for a
        CPU tensor and ``"VRAM"`` otherwise; DRAM views get device 0.

        With ``ppl`` > 1 (physical blocks per logical block, spec §2.3) each row is a
        logical block holding ``ppl`` kernel blocks: the defaults become
        ``num_blocks = shape[0] * ppl`` and stride and length divided by ``ppl``. With
        ``ppl == 1`` the view must have at least ``num_blocks`` rows.
        """
        if isinstance(ppl, bool) or not isinstance(ppl, int) or ppl < 1:
            raise CacheViewError(f"view {name!r}: ppl must be an int >= 1, got {ppl!r}")
        try:
            addr = int(tensor.data_ptr())
            shape = tuple(int(d) for d in tensor.shape)
            esize = int(tensor.element_size())
            strides = tuple(int(s) for s in tensor.stride())
        except AttributeError as exc:
            raise CacheViewError(
                f"view {name!r}: expected a tensor-like object with data_ptr(), shape, "
                f"stride() and element_size(), got {type(tensor).__name__}"
            ) from exc
        if not shape:
            raise CacheViewError(f"view {name!r}: a 0-d tensor cannot hold KV blocks")
        mem_type, device_id = tensor_mem_type(tensor, mem_type)

        if len(shape) == 1:
            nbytes = shape[0] * esize
            if num_blocks is None or num_blocks <= 0:
                raise CacheViewError(
                    f"view {name!r}: a flat 1-D view needs num_blocks > 0, got {num_blocks!r}"
                )
            if block_stride is None:
                if nbytes % num_blocks:
                    raise CacheViewError(
                        f"view {name!r}: {nbytes} bytes do not split into {num_blocks} blocks"
                    )
                block_stride = nbytes // num_blocks
            page = block_stride
        else:
            page = math.prod(shape[1:]) * esize
            row_stride = strides[0] * esize
            if page % ppl or row_stride % ppl:
                raise CacheViewError(
                    f"view {name!r}: a block of {page} bytes (row stride {row_stride}) does "
                    f"not split into ppl={ppl} kernel blocks"
                )
            page //= ppl
            if block_stride is None:
                block_stride = row_stride // ppl
            if num_blocks is None:
                num_blocks = shape[0] * ppl
            elif ppl == 1 and num_blocks > shape[0]:
                raise CacheViewError(
                    f"view {name!r}: num_blocks {num_blocks} exceeds the view's "
                    f"{shape[0]} rows in dimension 0"
                )
        if block_len is None:
            block_len = page

        reg_base = reg_nbytes = None
        storage_fn = getattr(tensor, "untyped_storage", None)
        if callable(storage_fn):
            storage = storage_fn()
            reg_base, reg_nbytes = int(storage.data_ptr()), int(storage.nbytes())
        return cls(
            name=name,
            group_id=group_id,
            addr=addr,
            num_blocks=num_blocks,
            block_len=block_len,
            block_stride=block_stride,
            mem_type=mem_type,
            device_id=device_id,
            reg_base=reg_base,
            reg_nbytes=reg_nbytes,
            is_mla=is_mla,
        )
