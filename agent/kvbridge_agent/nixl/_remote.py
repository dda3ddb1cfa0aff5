"""What the data plane needs to know about one remote engine rank.

:class:`RemoteEngine` is built from a decoded v11 ``NixlAgentMetadata`` (with the v10
fallbacks of spec §1.6, via ``protocol.effective_regions``) or, in tests and the producer's
own bookkeeping, from a local :class:`~.local.LocalEngine` (:meth:`LocalEngine.describe`).
It is plain data (picklable), so test harnesses can ship it over a pipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import rules

__all__ = ["RemoteEngine"]


@dataclass(frozen=True)
class RemoteEngine:
    """One remote engine rank: its NIXL agent and its per-region geometry.

    Attributes:
        engine_id: the remote engine id (``kv_transfer_params["remote_engine_id"]``).
        agent_metadata: the blob for ``add_remote_agent``.
        tp_rank / tp_size: this rank and the engine's transfer TP size.
        num_blocks: kernel block count of the main pool.
        block_size: kernel block size in tokens.
        ppl: physical (kernel) blocks per logical block.
        device_id: CUDA ordinal of the VRAM regions (DRAM always uses 0).
        base_addrs, block_lens, block_strides, region_num_blocks, region_group_ids,
        region_mem_types, region_names: per-region arrays, length R, in region order.
        agent_name: the NIXL agent name, when known before ``add_remote_agent``.
    """

    engine_id: str
    agent_metadata: bytes
    tp_rank: int
    tp_size: int
    num_blocks: int
    block_size: int
    ppl: int
    device_id: int
    base_addrs: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    region_num_blocks: tuple[int, ...]
    region_group_ids: tuple[int, ...]
    region_mem_types: tuple[str, ...]
    region_names: tuple[str, ...] | None = None
    agent_name: str | None = None

    def __post_init__(self) -> None:
        bad = rules.check_lengths(
            len(self.base_addrs), {n: getattr(self, n) for n in rules.PER_REGION_LISTS})
        bad += rules.check_strides(self.block_lens, self.block_strides)
        bad += [f for f in (rules.tp_rank(self.tp_rank, self.tp_size),) if f]
        if bad:
            raise ValueError(f"RemoteEngine {self.engine_id!r}: {bad[0].message}")
        if self.ppl < 1 or self.tp_size < 1:
            raise ValueError(
                f"RemoteEngine {self.engine_id!r}: expected ppl >= 1 and tp_size >= 1, "
                f"got ppl={self.ppl}, tp_size={self.tp_size}"
            )

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)

    @property
    def mem_kinds(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.region_mem_types)))

    @classmethod
    def from_metadata(
        cls,
        meta: Any,
        *,
        tp_rank: int,
        tp_size: int,
        local_region_group_ids: Any = None,
        local_mem_type: str = "VRAM",
    ) -> RemoteEngine:
        """Build from a decoded ``protocol.NixlAgentMetadata`` (v10 fields fall back as in
        spec §1.6: uniform capacities, the local groups, the local memory type)."""
        from ..protocol import effective_regions

        eff = effective_regions(
            meta,
            local_region_group_ids=None if local_region_group_ids is None
            else [int(g) for g in local_region_group_ids],
            local_mem_type=local_mem_type,
        )
        return cls(
            engine_id=meta.engine_id,
            agent_metadata=bytes(meta.agent_metadata),
            tp_rank=int(tp_rank),
            tp_size=int(tp_size),
            num_blocks=int(meta.num_blocks),
            block_size=int(meta.block_size),
            ppl=int(meta.physical_blocks_per_logical_kv_block),
            device_id=max(int(meta.device_id), 0),
            base_addrs=tuple(int(a) for a in meta.kv_caches_base_addr),
            block_lens=tuple(int(x) for x in meta.block_lens),
            block_strides=tuple(int(x) for x in meta.block_strides),
            region_num_blocks=tuple(int(x) for x in eff.num_blocks),
            region_group_ids=tuple(int(x) for x in eff.group_ids),
            region_mem_types=tuple(eff.mem_types),
            region_names=None if meta.region_names is None else tuple(meta.region_names),
        )
