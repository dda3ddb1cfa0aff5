"""Pure descriptor-id planning of one pull request (spec §4.2, §4.4, §4.5 steps 1-5).

No NIXL here: given the local plan, the remote description and the request's logical
block ids, decide the path (group-matched or region-mapped), expand ppl, align prefixes,
map sub-blocks and compute the paired local/remote descriptor ids. When clipping left
some of the request's local descriptors unread (k > 1 tails, ppl rounding, positional
padding), ``ReadIds.allocated_ids`` lists all of them, for zeroing (spec §4.9).

Descriptor ids go through ``geometry.DescIdLayout`` objects, one per (engine, k, path),
built by :func:`local_desc_layout` / :func:`remote_desc_layout` and cached by
:class:`~.local.LocalEngine` and the loaded :class:`~.peers.RemotePeer`, so a request pays
only ``layout.desc_ids`` (validation of the layout happens once per engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from .. import geometry as geo
from ._errors import UnsupportedTransferError
from ._remote import RemoteEngine

__all__ = [
    "ReadIds",
    "block_size_ratio",
    "local_desc_layout",
    "plan_read_ids",
    "remote_desc_layout",
]

IdLists = Sequence[Sequence[int] | np.ndarray]


@dataclass(frozen=True, eq=False)
class ReadIds:
    """Paired descriptor ids of one read; ``local_ids`` index the local list at ratio ``k``.

    ``allocated_ids``: every local descriptor id the request owns (its whole local block
    lists, all k sub-blocks, before any clipping), set only when some of them are not in
    ``local_ids``; those must be zeroed after a successful read (spec §4.9). None when the
    read covers everything the request owns.
    """

    k: int
    region_mapped: bool
    local_ids: np.ndarray
    remote_ids: np.ndarray
    allocated_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.local_ids.size)


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """k = local kernel block size // remote; only k >= 1 with exact division (spec §1.9)."""
    if remote_block_size < 1 or local_block_size % remote_block_size:
        raise UnsupportedTransferError(
            f"block size: local kernel block size {local_block_size} is not a multiple of "
            f"the remote's {remote_block_size}; only remote blocks that divide local ones "
            "are supported"
        )
    return local_block_size // remote_block_size


def local_desc_layout(plan: geo.RegionPlan, k: int, region_mapped: bool) -> geo.DescIdLayout:
    """The local descriptor-id layout at ratio ``k`` for the group-matched path, or (k = 1)
    the region-mapped one (each region its own group, spec §3.5)."""
    caps, names = plan.region_num_blocks, plan.names
    if region_mapped:
        r = len(caps)
        return geo.DescIdLayout(caps, np.arange(r), uses_group_mapping=r > 1,
                                region_names=names)
    gids = plan.group_ids
    return geo.DescIdLayout(caps, gids, uses_group_mapping=len(set(gids.tolist())) > 1,
                            block_size_ratio=k if k > 1 else None, region_names=names)


def remote_desc_layout(remote: RemoteEngine, region_mapped: bool) -> geo.DescIdLayout:
    """The descriptor-id layout of ``remote``'s list (ratio 1) for either path."""
    caps, gids, names = remote.region_num_blocks, remote.region_group_ids, remote.region_names
    if region_mapped:
        r = len(caps)
        return geo.DescIdLayout(caps, np.arange(r), uses_group_mapping=r > 1,
                                region_names=names)
    return geo.DescIdLayout(caps, gids, uses_group_mapping=len(set(gids)) > 1,
                            region_names=names)


def _sub_block_count(num_local: int, num_remote: int, k: int) -> int:
    """Remote blocks that land in ``num_local`` local blocks at ratio ``k``.

    The remote list covers the whole prompt (``ceil(num_remote / k)`` local blocks); the
    local list lacks the prefix-cache hits at its front. Only the remote blocks after those
    hits are read, so a partly filled last local block does not shift the pairing.
    """
    hit_blocks = max(-(-num_remote // k) - num_local, 0)
    return max(min(num_local * k, num_remote - hit_blocks * k), 0)


def plan_read_ids(
    plan: geo.RegionPlan,
    *,
    local_block_size: int,
    local_ppl: int,
    remote: RemoteEngine,
    local_block_ids: IdLists,
    remote_block_ids: IdLists,
    num_computed_blocks: Sequence[int] | None = None,
    remote_num_tokens: int | None = None,
    local_layout: Callable[[int, bool], geo.DescIdLayout] | None = None,
    remote_layout: Callable[[bool], geo.DescIdLayout] | None = None,
) -> ReadIds:
    """Descriptor ids for reading ``remote_block_ids`` of ``remote`` into ``local_block_ids``.

    ``local_layout(k, region_mapped)`` and ``remote_layout(region_mapped)`` supply the
    ``DescIdLayout`` objects (the cached ``LocalEngine.desc_layout`` and
    ``RemotePeer.layout``); without them they are built for this call.

    Raises:
        UnsupportedTransferError: region mapping needed but the model is not pure MLA, or
            k > 1 with region mapping, or incompatible block sizes.
        GeometryError: ids out of range (``BlockIdRangeError``), lists that cannot be
            paired (``PrefixAlignmentError``), group lists that do not fit the layout.
    """
    k = block_size_ratio(local_block_size, remote.block_size)
    local_groups = tuple(plan.group_ids.tolist())
    remote_groups = tuple(remote.region_group_ids) or local_groups
    local_kernel = [geo.expand_logical_to_kernel(g, local_ppl) for g in local_block_ids]
    remote_kernel = [geo.expand_logical_to_kernel(g, remote.ppl) for g in remote_block_ids]
    names = plan.names

    if local_groups != remote_groups:
        if not all(plan.is_mla):
            raise UnsupportedTransferError(
                "Different NIXL cache-group layouts are only supported for pure MLA models "
                f"(local region group ids {list(local_groups)}, remote "
                f"{list(remote_groups)})"
            )
        if k != 1:
            raise UnsupportedTransferError(
                "Region-mapped NIXL transfers require matching physical block sizes "
                f"(block_size_ratio {k})"
            )
        if len(local_groups) != len(remote_groups):
            raise UnsupportedTransferError(
                f"region-mapped read: local has {len(local_groups)} regions, remote "
                f"{len(remote_groups)}; regions pair by index"
            )
        local_by_region = geo.block_ids_by_region(local_kernel, local_groups, region_names=names)
        remote_by_region = geo.block_ids_by_region(
            remote_kernel, remote_groups, region_names=names)
        positional = num_computed_blocks is not None and remote_num_tokens is not None
        if positional:
            starts = [int(num_computed_blocks[g]) * local_ppl if g >= 0 else 0
                      for g in local_groups]
            num_remote = -(-int(remote_num_tokens) // remote.block_size)
            d, p = geo.align_prefix_by_region(
                local_by_region, remote_by_region, num_computed_blocks=np.array(starts),
                num_remote_blocks=num_remote, region_names=names)
        else:
            d, p = geo.align_prefix_by_region(local_by_region, remote_by_region,
                                              region_names=names)
        llayout = (local_layout or partial(local_desc_layout, plan))(1, True)
        lids = llayout.desc_ids(d)
        rids = (remote_layout or partial(remote_desc_layout, remote))(True).desc_ids(p)
        allocated = None
        if _count(d) < _count(local_by_region):      # positional rule: allocation padding
            allocated = llayout.desc_ids(local_by_region)
        return ReadIds(1, True, lids, rids, allocated)

    owned = local_kernel
    if k > 1:
        owned = [geo.map_to_sub_blocks(lg, k) for lg in local_kernel]
        local_kernel = [
            geo.map_to_sub_blocks(lg, k, _sub_block_count(len(lg), len(rg), k))
            for lg, rg in zip(local_kernel, remote_kernel, strict=False)
        ]
    d, p = geo.align_prefix_by_group(local_kernel, remote_kernel,
                                     max_padding=local_ppl + remote.ppl)
    llayout = (local_layout or partial(local_desc_layout, plan))(k, False)
    lids = llayout.desc_ids(d)
    allocated = None
    if _count(d) < _count(owned):          # k > 1 tails, ppl rounding clipped D's pages
        allocated = llayout.desc_ids(owned)
    if remote.region_group_ids:
        rids = (remote_layout or partial(remote_desc_layout, remote))(False).desc_ids(p)
    else:   # a remote without regions: the same GroupLayoutError as before caching
        rids = geo.compute_desc_ids(p, remote.region_num_blocks, remote_groups,
                                    uses_group_mapping=len(set(local_groups)) > 1,
                                    region_names=names)
    if lids.size != rids.size:
        raise geo.PrefixAlignmentError(
            f"local and remote descriptor ids differ in count ({lids.size} vs {rids.size}); "
            "the request's per-group block lists cannot be paired"
        )
    return ReadIds(k, False, lids, rids, allocated)


def _count(lists: Sequence[np.ndarray]) -> int:
    return sum(int(x.size) for x in lists)
