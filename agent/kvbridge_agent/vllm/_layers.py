"""vLLM's per-layer KV caches as kvbridge ``CacheView`` objects (spec §2.3, step 6).

Pure and duck-typed (tensors need ``data_ptr()``, ``shape``, ``stride()``,
``element_size()``, ``nbytes``, ``device``, ``untyped_storage()`` and indexing): the
connector collects the facts vLLM knows per layer (transfer group, page size, capacity, MLA
or not, host-resident or not) into :class:`LayerCache` items, and :func:`layer_views` turns
each into the view vLLM's own worker would register, so that both produce the same regions
and a kvbridge engine and a stock one line up index by index. Layouts vLLM cuts into
several segments per layer (K and V planes first) are refused with the layer named: they
would give several regions one name, which kvbridge's region plan does not accept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import KVBridgeError
from ..geometry import CacheView, tensor_mem_type

__all__ = ["LayerCache", "UnsupportedLayoutError", "layer_views"]


class UnsupportedLayoutError(KVBridgeError, ValueError):
    """A KV cache view whose layout kvbridge does not register (the message names it)."""


@dataclass(frozen=True)
class LayerCache:
    """What vLLM knows about one layer's cache at ``register_kv_caches``.

    Attributes:
        name: the layer name (``model.layers.3.self_attn.attn``).
        tensor: the cache view vLLM hands over.
        group_id: index of the layer's transfer group.
        page_bytes: bytes of one kernel (physical) block of this layer.
        num_blocks: the region's capacity in kernel blocks.
        is_mla: an MLA (replicated latent) layer.
        host_resident: the group lives in a host pool, registered by the view's own range.
    """

    name: str
    tensor: Any
    group_id: int
    page_bytes: int
    num_blocks: int
    is_mla: bool = False
    host_resident: bool = False


def _registration(layer: LayerCache) -> tuple[int, int]:
    t = layer.tensor
    if layer.host_resident:
        return int(t.data_ptr()), int(t.nbytes)
    storage = t.untyped_storage()
    return int(storage.data_ptr()), int(storage.nbytes())


def layer_view(layer: LayerCache) -> CacheView:
    """The region vLLM registers for one attention layer (spec §2.3 step 6)."""
    t, page, nb = layer.tensor, int(layer.page_bytes), int(layer.num_blocks)
    mem_type, device_id = tensor_mem_type(t)
    reg_base, reg_len = _registration(layer)
    ndim = len(t.shape)
    block_stride = page if ndim == 1 else int(t.stride(0)) * int(t.element_size())
    block_major = nb * block_stride == reg_len
    page_contiguous = ndim > 1 and bool(t[0].is_contiguous()) and int(t[0].nbytes) == page
    addr, block_len = int(t.data_ptr()), page
    if block_major and not page_contiguous:
        # Several layers interleave inside each block of one storage: whole storage rows.
        addr, block_len = reg_base, reg_len // nb
        block_stride = block_len
    elif not block_major:
        segment = nb * block_stride
        if segment <= 0 or int(t.nbytes) % segment:
            raise UnsupportedLayoutError(
                f"KV cache of layer {layer.name!r} (shape {tuple(t.shape)}, stride "
                f"{tuple(t.stride())}) cannot be partitioned into {nb} blocks of stride "
                f"{block_stride} bytes")
        if int(t.nbytes) // segment > 1:
            raise UnsupportedLayoutError(
                f"KV cache of layer {layer.name!r} (shape {tuple(t.shape)}) splits into "
                f"{int(t.nbytes) // segment} planes per block (K and V first); kvbridge needs "
                "block-major caches (K and V packed per block), as vLLM's NIXL layout "
                "(LBHNC) gives")
    if layer.host_resident:
        reg_base, reg_len = None, None   # registered by the view's own blocks
    return CacheView(
        name=layer.name, group_id=int(layer.group_id), addr=addr, num_blocks=nb,
        block_len=block_len, block_stride=block_stride, mem_type=mem_type,
        device_id=device_id, reg_base=reg_base, reg_nbytes=reg_len, is_mla=layer.is_mla)


def layer_views(layers: Iterable[LayerCache]) -> list[CacheView]:
    """One view per layer; ``plan_regions`` then orders and deduplicates them as vLLM does."""
    return [layer_view(layer) for layer in layers]
