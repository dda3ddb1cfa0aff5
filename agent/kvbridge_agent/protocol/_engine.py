"""Engine geometry as the validation rules see it, and the §1.6 fallback for older peers.

:class:`EngineGeometry` holds plain values, so it can be built from a vLLM handshake
(:meth:`EngineGeometry.from_metadata` plus the engine facts that are not on the wire), from a
KVEndpoint spec (:meth:`EngineGeometry.from_regions` / :meth:`EngineGeometry.from_dict`), or
from a JSON file (``kvbridge probe --geometry``). Construction never validates: a malformed
remote must become a :class:`Verdict` listing its problems, not an exception.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..resources import geometry_aliases, region_aliases
from ..rules import NIXL_CONNECTOR_VERSION, PER_REGION_LISTS
from ._wire import NixlAgentMetadata

_TUPLE_FIELDS = (*PER_REGION_LISTS, "ssm_sizes")


@dataclass(frozen=True)
class RegionGeometry:
    """One transfer region as a KVEndpoint spec lists it (``spec.geometry.regions[i]``)."""

    name: str
    num_blocks: int
    group_id: int
    mem_type: str
    block_len: int
    block_stride: int


@dataclass(frozen=True)
class EngineGeometry:
    """What :func:`validate_remote` needs to know about one engine rank.

    Lists may be passed as any sequence; they are stored as tuples. The four v11 region
    arrays are ``None`` for a v10 peer. ``num_kv_heads`` is the model's total KV head count
    (``None``: assume heads divide evenly by TP). ``num_base_addrs`` is
    ``len(kv_caches_base_addr)`` when built from metadata, ``None`` otherwise.
    """

    engine_id: str
    tp_size: int
    block_size: int
    num_blocks: int
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    kv_cache_layout: str
    attn_backend_name: str = ""
    physical_blocks_per_logical_kv_block: int = 1
    region_num_blocks: tuple[int, ...] | None = None
    region_group_ids: tuple[int, ...] | None = None
    region_names: tuple[str, ...] | None = None
    region_mem_types: tuple[str, ...] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    is_mla: bool = False
    num_kv_heads: int | None = None
    tp_rank: int = 0
    protocol_version: int = NIXL_CONNECTOR_VERSION
    compatibility_hash: str | None = None
    transfer_mode: str | None = None
    ssm_sizes: tuple[int, ...] = (0, 0)
    num_base_addrs: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    @property
    def num_regions(self) -> int:
        """R: the number of transfer regions (``len(block_lens)``)."""
        return len(self.block_lens)

    @property
    def has_mamba(self) -> bool:
        """True for hybrid SSM models (non-zero ``ssm_sizes``)."""
        return any(self.ssm_sizes)

    @classmethod
    def from_metadata(
        cls,
        meta: NixlAgentMetadata,
        *,
        tp_size: int,
        is_mla: bool,
        num_kv_heads: int | None = None,
        tp_rank: int = 0,
        protocol_version: int = NIXL_CONNECTOR_VERSION,
        compatibility_hash: str | None = None,
        transfer_mode: str | None = None,
    ) -> EngineGeometry:
        """Combine decoded metadata with the engine facts the wire does not carry."""
        return cls(
            engine_id=meta.engine_id,
            tp_size=tp_size,
            block_size=meta.block_size,
            num_blocks=meta.num_blocks,
            block_lens=meta.block_lens,
            block_strides=meta.block_strides,
            kv_cache_layout=meta.kv_cache_layout,
            attn_backend_name=meta.attn_backend_name,
            physical_blocks_per_logical_kv_block=meta.physical_blocks_per_logical_kv_block,
            region_num_blocks=meta.region_num_blocks,
            region_group_ids=meta.region_group_ids,
            region_names=meta.region_names,
            region_mem_types=meta.region_mem_types,
            dcp_size=meta.dcp_size,
            pcp_size=meta.pcp_size,
            is_mla=is_mla,
            num_kv_heads=num_kv_heads,
            tp_rank=tp_rank,
            protocol_version=protocol_version,
            compatibility_hash=compatibility_hash,
            transfer_mode=transfer_mode,
            ssm_sizes=meta.ssm_sizes,
            num_base_addrs=len(meta.kv_caches_base_addr),
        )

    @classmethod
    def from_regions(
        cls, regions: Iterable[RegionGeometry | Mapping[str, Any]], **engine: Any
    ) -> EngineGeometry:
        """Build from per-region records (KVEndpoint ``regions``) plus engine-wide values.

        ``regions`` items are :class:`RegionGeometry` or mappings with its field names (snake
        or camelCase). ``engine`` takes the remaining :class:`EngineGeometry` fields by name.
        """
        rs = [r if isinstance(r, RegionGeometry) else _region_from_mapping(r) for r in regions]
        return cls(
            block_lens=tuple(r.block_len for r in rs),
            block_strides=tuple(r.block_stride for r in rs),
            region_num_blocks=tuple(r.num_blocks for r in rs),
            region_group_ids=tuple(r.group_id for r in rs),
            region_names=tuple(r.name for r in rs),
            region_mem_types=tuple(r.mem_type for r in rs),
            **engine,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = True) -> EngineGeometry:
        """Build from a JSON-like mapping (the ``--geometry`` file format).

        Keys are :class:`EngineGeometry` / :class:`NixlAgentMetadata` field names, or the
        KVEndpoint camelCase spellings (``blockSize``, ``tpSize``, ``layout``,
        ``attentionBackend``, ``physicalBlocksPerLogical``, ...). Per-region data comes either
        as flat lists (``block_lens``, ``region_names``, ...) or as ``regions: [{name,
        numBlocks, groupId, memType, blockLen, blockStride}]``. ``kv_caches_base_addr`` only
        sets ``num_base_addrs``. Unknown keys raise ``ValueError`` when ``strict``.
        """
        values: dict[str, Any] = {}
        unknown: list[str] = []
        regions = None
        known = {f.name for f in fields(cls)}
        for key, value in data.items():
            name = _ALIASES.get(key, key)
            if name == "regions":
                regions = value
            elif name == "kv_caches_base_addr":
                values["num_base_addrs"] = len(value)
            elif name in known:
                values[name] = value
            elif name not in _IGNORED:
                unknown.append(key)
        if unknown and strict:
            raise ValueError(f"geometry: unknown keys {sorted(unknown)}; expected {sorted(known)}")
        required = ("engine_id", "tp_size", "block_size", "num_blocks")
        missing = [n for n in required if n not in values]
        if regions is None:
            missing += [n for n in ("block_lens", "block_strides") if n not in values]
        missing += [] if "kv_cache_layout" in values else ["kv_cache_layout"]
        if missing:
            raise ValueError(f"geometry: missing required keys {missing}")
        if regions is not None:
            return cls.from_regions(regions, **values)
        return cls(**values)


def _region_from_mapping(data: Mapping[str, Any]) -> RegionGeometry:
    names = {f.name for f in fields(RegionGeometry)}
    values = {_REGION_ALIASES.get(k, k): v for k, v in data.items()}
    bad = sorted(set(values) - names)
    missing = sorted(names - set(values))
    if bad or missing:
        raise ValueError(
            f"geometry.regions: expected keys {sorted(names)}, missing {missing}, unknown {bad}"
        )
    return RegionGeometry(**values)


#: camelCase keys -> field names: the KVEndpoint's (from its field table), plus the short and
#: wire spellings geometry files used before.
_ALIASES = geometry_aliases({"layout": "kv_cache_layout", "mla": "is_mla",
                             "ssmSizes": "ssm_sizes"})
_REGION_ALIASES = region_aliases()
# Metadata fields that say nothing about compatibility.
_IGNORED = frozenset({"agent_metadata", "device_id", "agentMetadata", "deviceId"})


@dataclass(frozen=True)
class EffectiveRegions:
    """Per-region arrays as D records them for a remote engine (spec §1.6 ``dst_*`` maps)."""

    num_blocks: tuple[int, ...]
    group_ids: tuple[int, ...]
    mem_types: tuple[str, ...]

    @property
    def uses_group_mapping(self) -> bool:
        """``dst_uses_region_group_mapping``: more than one distinct group id."""
        return len(set(self.group_ids)) > 1

    @property
    def mixed_mem_types(self) -> bool:
        """More than one memory type among the regions."""
        return len(set(self.mem_types)) > 1


def effective_regions(
    remote: NixlAgentMetadata | EngineGeometry,
    *,
    local_region_group_ids: Sequence[int] | None = None,
    local_mem_type: str = "VRAM",
) -> EffectiveRegions:
    """Resolve the v11 arrays with the §1.6/§1.7 fallbacks for a v10 (``None``) peer.

    - ``region_num_blocks`` or ``[num_blocks] * R``;
    - ``region_group_ids``, else the local group ids when their length is R, else ``[0] * R``;
    - ``region_mem_types`` or ``[local_mem_type] * R``.

    R is ``len(kv_caches_base_addr)`` for metadata and ``len(block_lens)`` for a geometry.
    The fallback is only correct when the peer's real geometry is uniform (§1.7).
    """
    if isinstance(remote, NixlAgentMetadata):
        r = len(remote.kv_caches_base_addr)
    else:
        r = remote.num_regions
    num_blocks = remote.region_num_blocks
    if num_blocks is None:
        num_blocks = [remote.num_blocks] * r
    group_ids = remote.region_group_ids
    if group_ids is None:
        if local_region_group_ids is not None and len(local_region_group_ids) == r:
            group_ids = local_region_group_ids
        else:
            group_ids = [0] * r
    mem_types = remote.region_mem_types
    if mem_types is None:
        mem_types = [local_mem_type] * r
    return EffectiveRegions(tuple(num_blocks), tuple(group_ids), tuple(mem_types))
