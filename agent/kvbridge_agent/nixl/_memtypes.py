"""The one place that maps a region's logical memory kind to a NIXL memory type.

Regions carry a logical kind (``"DRAM"`` for host pools, ``"VRAM"`` for device pools, as in
the v11 metadata). NIXL needs a memory type per registration and per descriptor list. In
production the two coincide; on a CPU-only machine NIXL refuses ``"VRAM"`` for host memory
(docs/platform/nixl-on-cpu.md §6), so tests map both kinds to ``"DRAM"`` and let two DRAM pools play
the DRAM and VRAM roles. Everything else (one dlist per (side, kind), one transfer per kind
pair) is keyed by the logical kind, so the split logic is exercised identically in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["CPU_TEST_MEM_TYPES", "PRODUCTION_MEM_TYPES", "MemTypeMap"]


@dataclass(frozen=True)
class MemTypeMap:
    """Logical memory kind -> NIXL memory type, plus the device id registrations use."""

    name: str
    mapping: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mapping", MappingProxyType(dict(self.mapping)))

    def nixl_type(self, kind: str) -> str:
        """The NIXL memory type for ``kind``.

        Raises:
            ValueError: ``kind`` is not in this map (names the map and the known kinds).
        """
        try:
            return self.mapping[kind]
        except KeyError:
            raise ValueError(
                f"memory kind {kind!r}: not in mem-type map {self.name!r} "
                f"(known: {sorted(self.mapping)})"
            ) from None

    def device_id(self, kind: str, device_id: int) -> int:
        """Device id for a descriptor of ``kind``: NIXL DRAM is always device 0 (spec §2.6)."""
        return 0 if self.nixl_type(kind) == "DRAM" else max(int(device_id), 0)


PRODUCTION_MEM_TYPES = MemTypeMap("production", {"DRAM": "DRAM", "VRAM": "VRAM"})
CPU_TEST_MEM_TYPES = MemTypeMap("cpu-test", {"DRAM": "DRAM", "VRAM": "DRAM"})
