"""Errors raised by :mod:`kvbridge_agent.geometry`.

Every error is a :class:`GeometryError`, itself a :class:`ValueError`, so callers that only
care about "the geometry is wrong" catch one class. Messages name the region (layer name
and/or index), the group or the argument at fault, the expected and the actual value.

::

    ValueError
     └── GeometryError
          ├── CacheViewError            a CacheView field is invalid (names the layer and field)
          ├── RegionAliasError          two views overlap without being an exact alias
          ├── MemoryTypeConflictError   one address registered with two memory types
          ├── GroupLayoutError          group/region arrays disagree, a group has no region
          ├── BlockIdRangeError         a block id lies outside a region's capacity
          ├── PrefixAlignmentError      local/remote per-region lists cannot be paired
          ├── TPMappingError            tensor-parallel sizes/ranks that do not map
          └── UnsupportedGeometryError  (also NotImplementedError) valid, but not supported
"""

from __future__ import annotations

from ..errors import KVBridgeError

__all__ = [
    "BlockIdRangeError",
    "CacheViewError",
    "GeometryError",
    "GroupLayoutError",
    "MemoryTypeConflictError",
    "PrefixAlignmentError",
    "RegionAliasError",
    "TPMappingError",
    "UnsupportedGeometryError",
]


class GeometryError(KVBridgeError, ValueError):
    """Base class: the KV cache geometry or a request's block ids are inconsistent."""


class CacheViewError(GeometryError):
    """A CacheView (or an argument building one) has an invalid field."""


class RegionAliasError(GeometryError):
    """Two views' block byte ranges overlap without being an exact alias."""


class MemoryTypeConflictError(GeometryError):
    """One base address (or registration base) is claimed with two memory types."""


class GroupLayoutError(GeometryError):
    """Per-region group ids, per-group block lists or region arrays do not fit together."""


class BlockIdRangeError(GeometryError):
    """A block id is negative or not below the capacity of a region it targets."""


class PrefixAlignmentError(GeometryError):
    """Local and remote per-region block lists cannot be aligned for a transfer."""


class TPMappingError(GeometryError):
    """Tensor-parallel sizes or ranks that cannot be mapped onto each other."""


class UnsupportedGeometryError(GeometryError, NotImplementedError):
    """A consistent geometry that this version deliberately does not support."""
