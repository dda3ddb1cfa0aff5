"""Region model and registration planning (spec §2.2–§2.6).

:func:`plan_regions` turns per-layer :class:`CacheView` objects into a :class:`RegionPlan`:
the per-region arrays published in the v11 handshake and the memory ranges to register.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .. import rules
from ..rules import SHARED_GROUP_ID
from ._errors import (
    GeometryError,
    MemoryTypeConflictError,
    RegionAliasError,
    UnsupportedGeometryError,
)
from ._views import MEM_TYPES, CacheView, block_extent

__all__ = [
    "SHARED_GROUP_ID",
    "Region",
    "RegionPlan",
    "RegistrationRange",
    "plan_regions",
    "region_sort_key",
]

_RUNS = re.compile(r"\d+|\D+")


def region_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Natural-sort key of a layer name (spec §2.2).

    The name is split into digit and text runs; digit runs compare as integers, text runs
    as strings, and a digit run orders before a text run at the same position.
    ``layers.2`` < ``layers.10``; ``a1`` < ``ab``.
    """
    return tuple(
        (0, int(run)) if run[0].isdigit() else (1, run) for run in _RUNS.findall(name)
    )


@dataclass(frozen=True)
class Region:
    """One transfer region: a row of the per-region arrays of the handshake."""

    index: int
    name: str
    addr: int
    block_len: int
    block_stride: int
    num_blocks: int
    group_id: int
    mem_type: str
    device_id: int
    is_mla: bool
    #: every layer folded into this region, in region order (the v12 ``region_members``)
    members: tuple[str, ...] = ()

    @property
    def extent(self) -> int:
        """Bytes from ``addr`` to the end of the last block (0 for an empty region)."""
        return block_extent(self.num_blocks, self.block_stride, self.block_len)

    @property
    def shared(self) -> bool:
        """True when several transfer groups overlay this region (group id -1)."""
        return self.group_id == SHARED_GROUP_ID


@dataclass(frozen=True)
class RegistrationRange:
    """One memory range for NIXL ``register_memory``: (start, length, device id, type)."""

    start: int
    length: int
    device_id: int
    mem_type: str


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class RegionPlan:
    """Regions in natural layer-name order plus the registrations that back them.

    The array properties are read-only numpy arrays, computed once.
    """

    regions: tuple[Region, ...]
    registrations: tuple[RegistrationRange, ...]

    def __len__(self) -> int:
        return len(self.regions)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    @cached_property
    def addrs(self) -> np.ndarray:
        return _readonly(np.array([r.addr for r in self.regions], dtype=np.uint64))

    @cached_property
    def block_lens(self) -> np.ndarray:
        return _readonly(np.array([r.block_len for r in self.regions], dtype=np.int64))

    @cached_property
    def block_strides(self) -> np.ndarray:
        return _readonly(np.array([r.block_stride for r in self.regions], dtype=np.int64))

    @cached_property
    def region_num_blocks(self) -> np.ndarray:
        return _readonly(np.array([r.num_blocks for r in self.regions], dtype=np.int64))

    @cached_property
    def group_ids(self) -> np.ndarray:
        return _readonly(np.array([r.group_id for r in self.regions], dtype=np.int64))

    @cached_property
    def device_ids(self) -> np.ndarray:
        return _readonly(np.array([r.device_id for r in self.regions], dtype=np.int64))

    @cached_property
    def is_mla(self) -> tuple[bool, ...]:
        return tuple(r.is_mla for r in self.regions)

    @cached_property
    def mem_types(self) -> tuple[str, ...]:
        return tuple(r.mem_type for r in self.regions)

    @property
    def uses_group_mapping(self) -> bool:
        """More than one distinct group id (spec §2.5); all -1 or one group means no."""
        return len({r.group_id for r in self.regions}) > 1

    @property
    def mixed_mem_types(self) -> bool:
        return len(set(self.mem_types)) > 1

    @property
    def num_descs(self) -> int:
        """Σ region capacities: the local dlist length at block-size ratio 1."""
        return int(sum(r.num_blocks for r in self.regions))

    def registrations_for(self, mem_type: str) -> tuple[RegistrationRange, ...]:
        """The registration ranges of one memory type, in plan order."""
        return tuple(g for g in self.registrations if g.mem_type == mem_type)


@dataclass
class _Building:
    view: CacheView  # first view registered at this key: its name names the region
    block_stride: int
    num_blocks: int
    group_id: int
    is_mla: bool
    members: list[str]


def _blocks_overlap(a: _Building, b: _Building) -> bool:
    """Whether any block byte range of ``a`` intersects one of ``b`` (exact)."""
    na, nb = a.num_blocks, b.num_blocks
    if na == 0 or nb == 0:
        return False
    a0, la, sa = a.view.addr, a.view.block_len, a.block_stride
    b0, lb, sb = b.view.addr, b.view.block_len, b.block_stride
    if a0 >= b0 + (nb - 1) * sb + lb or b0 >= a0 + (na - 1) * sa + la:
        return False  # the hulls are disjoint
    if sa == sb:
        # block i of a and j of b meet iff -lb < (b0 - a0) + m*s < la with m = j - i:
        # an integer interval of m, intersected with the reachable [-(na-1), nb-1].
        d, s = b0 - a0, sa
        m_lo = (-lb - d) // s + 1
        m_hi = -((d - la) // s) - 1
        return max(m_lo, -(na - 1)) <= min(m_hi, nb - 1)
    # Different strides: for every block of a, the candidate blocks of b (b's blocks never
    # overlap each other since len <= stride), vectorized over a's blocks.
    starts = a0 + np.arange(na, dtype=object if a0 + na * sa >= 2**62 else np.int64) * sa
    j_lo = np.maximum((starts - lb - b0) // sb + 1, 0)
    j_hi = np.minimum(-((b0 - starts - la) // sb) - 1, nb - 1)
    return bool(np.any(j_lo <= j_hi))


def _conflict_check(built: list[_Building]) -> None:
    order = sorted(range(len(built)), key=lambda i: built[i].view.addr)
    for pos, i in enumerate(order):
        a = built[i]
        if a.num_blocks == 0:
            continue
        end = a.view.addr + (a.num_blocks - 1) * a.block_stride + a.view.block_len
        for j in order[pos + 1 :]:
            b = built[j]
            if b.view.addr >= end:
                break
            va, vb = a.view, b.view
            if va.mem_type == vb.mem_type == "VRAM" and va.device_id != vb.device_id:
                continue  # device pointers of different GPUs
            if va.addr == vb.addr and va.mem_type != vb.mem_type:
                raise MemoryTypeConflictError(
                    f"views {va.name!r} ({va.mem_type}) and {vb.name!r} ({vb.mem_type}) "
                    f"share base address {va.addr:#x} with different memory types"
                )
            if _blocks_overlap(a, b):
                raise RegionAliasError(
                    f"views {va.name!r} (addr {va.addr:#x}, block_len {va.block_len}, "
                    f"stride {a.block_stride}, {a.num_blocks} blocks) and {vb.name!r} "
                    f"(addr {vb.addr:#x}, block_len {vb.block_len}, stride {b.block_stride}, "
                    f"{b.num_blocks} blocks) overlap without being an exact alias; only "
                    "views with identical base address, block length, stride and memory "
                    "type may share memory"
                )


def plan_regions(views: Iterable[CacheView]) -> RegionPlan:
    """Plan transfer regions and memory registrations for a set of KV cache views.

    Views are visited in natural layer-name order (:func:`region_sort_key`). Views with the
    same (base address, block length, memory type) fold into one region (spec §2.4): the
    region keeps the first layer's name, its MLA flag is OR-ed, an MLA view's capacity
    wins, and a second group turns its group id into -1. Registrations are deduplicated by
    (registration base, memory type), DRAM first, DRAM always on device 0.

    Raises :class:`MemoryTypeConflictError` for two memory types at one base address,
    :class:`RegionAliasError` for block ranges that overlap without being an exact alias
    (including equal base and length with a different stride),
    :class:`UnsupportedGeometryError` for mixed memory types with a non-MLA region, and
    :class:`GeometryError` for no views or duplicate layer names.
    """
    views = list(views)
    if not views:
        raise GeometryError("plan_regions: no KV cache views given")
    for v in views:
        if not isinstance(v, CacheView):
            raise GeometryError(
                f"plan_regions: expected CacheView objects, got {type(v).__name__}"
            )
    views.sort(key=lambda v: region_sort_key(v.name))
    seen: set[str] = set()
    built: list[_Building] = []
    by_key: dict[tuple[int, int, str, int], _Building] = {}
    regs: dict[tuple[int, str], list] = {}  # (start, mem_type) -> [start, len, dev, type, name]
    reg_types: dict[int, tuple[str, str]] = {}  # start -> (mem_type, first layer)

    for v in views:
        if v.name in seen:
            raise GeometryError(f"plan_regions: layer name {v.name!r} appears twice")
        seen.add(v.name)
        device_id = 0 if v.mem_type == "DRAM" else v.device_id

        start, length = v.registration
        if length > 0:
            other = reg_types.setdefault(start, (v.mem_type, v.name))
            if other[0] != v.mem_type:
                raise MemoryTypeConflictError(
                    f"views {other[1]!r} ({other[0]}) and {v.name!r} ({v.mem_type}) share "
                    f"registration base {start:#x} with different memory types"
                )
            entry = regs.get((start, v.mem_type))
            if entry is None:
                regs[(start, v.mem_type)] = [start, length, device_id, v.mem_type]
            else:
                entry[1] = max(entry[1], length)

        key = (v.addr, v.block_len, v.mem_type, device_id)
        b = by_key.get(key)
        if b is None:
            b = _Building(v, v.block_stride, v.num_blocks, v.group_id, v.is_mla, [v.name])
            by_key[key] = b
            built.append(b)
            continue
        if b.block_stride != v.block_stride:
            raise RegionAliasError(
                f"views {b.view.name!r} and {v.name!r} share base address {v.addr:#x} and "
                f"block length {v.block_len} but differ in block_stride "
                f"({b.block_stride} vs {v.block_stride})"
            )
        b.members.append(v.name)
        if v.is_mla:
            b.num_blocks = v.num_blocks  # MLA geometry wins (spec §2.4)
        b.is_mla = b.is_mla or v.is_mla
        if v.group_id != b.group_id:
            b.group_id = SHARED_GROUP_ID

    _conflict_check(built)

    regions = tuple(
        Region(
            index=i,
            name=b.view.name,
            addr=b.view.addr,
            block_len=b.view.block_len,
            block_stride=b.block_stride,
            num_blocks=b.num_blocks,
            group_id=b.group_id,
            mem_type=b.view.mem_type,
            device_id=0 if b.view.mem_type == "DRAM" else b.view.device_id,
            is_mla=b.is_mla,
            members=tuple(b.members),
        )
        for i, b in enumerate(built)
    )
    non_mla = [r.name for r in regions if not r.is_mla]
    more = f" and {len(non_mla) - 5} more" if len(non_mla) > 5 else ""
    if bad := rules.mixed_needs_mla(
        (r.mem_type for r in regions), is_mla=not non_mla,
        note=f"non-MLA region(s): {', '.join(map(repr, non_mla[:5]))}{more}",
    ):
        raise UnsupportedGeometryError(bad.message)
    rank = {t: i for i, t in enumerate(MEM_TYPES)}
    registrations = tuple(
        RegistrationRange(start=e[0], length=e[1], device_id=e[2], mem_type=e[3])
        for e in sorted(regs.values(), key=lambda e: rank.get(e[3], len(rank)))
    )
    return RegionPlan(regions=regions, registrations=registrations)
