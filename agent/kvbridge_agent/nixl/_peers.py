"""Remote agents this engine talks to, and the descriptor lists prepared against them.

One entry per remote (engine id, TP rank). Re-adding an entry (a restarted peer, a new
epoch) first drops the stale one: its prepared lists are released and its agent removed,
because NIXL refuses to load metadata under a name it already holds
(docs/platform/nixl-on-cpu.md §5b) and old prepared lists would point at dead memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import geometry as geo
from ._agent import DList, NixlAgent
from ._errors import NixlCallError, RemoteNotFoundError
from ._remote import RemoteEngine

__all__ = ["RemotePeer", "RemotePeers"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RemotePeer:
    """A loaded remote rank: its description, NIXL agent name, prepared lists and
    descriptor-id layouts (both built on first use, dropped with the entry)."""

    desc: RemoteEngine
    agent_name: str
    index: Any  # geometry.MemTypeIndex of the remote descriptors (k = 1)
    lists: dict[Hashable, dict[str, DList]] = field(default_factory=dict)
    layouts: dict[bool, geo.DescIdLayout] = field(default_factory=dict)

    def layout(self, region_mapped: bool) -> geo.DescIdLayout:
        """The ``DescIdLayout`` of this rank's list (ratio 1) for the group-matched path or
        the region-mapped one (``_readplan.remote_desc_layout``), cached."""
        got = self.layouts.get(region_mapped)
        if got is None:
            from ._readplan import remote_desc_layout

            got = self.layouts[region_mapped] = remote_desc_layout(self.desc, region_mapped)
        return got


class RemotePeers:
    """Add, look up and drop remote engine ranks on one :class:`NixlAgent`."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self._peers: dict[tuple[str, int], RemotePeer] = {}

    def add(self, desc: RemoteEngine) -> RemotePeer:
        """Load ``desc`` (replacing a stale entry for the same engine id and rank)."""
        key = (desc.engine_id, desc.tp_rank)
        if key in self._peers:
            self._drop(key)
        if desc.agent_name is not None:
            for other_key, other in list(self._peers.items()):
                if other.agent_name == desc.agent_name:
                    self._drop(other_key)
            if self.agent.has_remote(desc.agent_name):
                self.agent.remove_remote(desc.agent_name)
        name = self.agent.add_remote(desc.agent_metadata)
        index = geo.mem_type_index(desc.region_mem_types, desc.region_num_blocks)
        peer = RemotePeer(desc=desc, agent_name=name, index=index)
        self._peers[key] = peer
        return peer

    def _drop(self, key: tuple[str, int]) -> None:
        peer = self._peers.pop(key)
        try:
            self.agent.remove_remote(peer.agent_name)
        except NixlCallError as exc:
            log.warning("removing stale remote %s (%s rank %d) failed: %s",
                        peer.agent_name, key[0], key[1], exc)
        peer.lists.clear()
        peer.layouts.clear()

    def remove(self, engine_id: str, tp_rank: int | None = None) -> list[str]:
        """Drop one rank (or every rank) of an engine; returns the removed agent names."""
        keys = [k for k in self._peers if k[0] == engine_id and tp_rank in (None, k[1])]
        names = [self._peers[k].agent_name for k in keys]
        for k in keys:
            self._drop(k)
        return names

    def get(self, engine_id: str, tp_rank: int) -> RemotePeer:
        try:
            return self._peers[(engine_id, tp_rank)]
        except KeyError:
            known = sorted({k[0] for k in self._peers})
            raise RemoteNotFoundError(
                f"remote engine {engine_id!r} rank {tp_rank} was not added (known engines: "
                f"{known}); add it with add_remote() after its handshake"
            ) from None

    def ranks(self, engine_id: str) -> dict[int, RemotePeer]:
        return {k[1]: p for k, p in self._peers.items() if k[0] == engine_id}

    def any_rank(self, engine_id: str) -> RemotePeer:
        ranks = self.ranks(engine_id)
        if not ranks:
            self.get(engine_id, 0)  # raises RemoteNotFoundError with the known engines
        return ranks[min(ranks)]

    def lists(
        self, peer: RemotePeer, key: Hashable, build_table: Callable[[], np.ndarray]
    ) -> dict[str, DList]:
        """The remote lists of ``peer`` for ``key``, one per remote kind, built once."""
        got = peer.lists.get(key)
        if got is None:
            parts = geo.split_table_by_mem_type(build_table(), peer.index)
            got = {kind: self.agent.prep_remote(peer.agent_name, parts[kind], kind)
                   for kind in peer.index.mem_types}
            peer.lists[key] = got
        return got

    def close(self) -> None:
        for key in list(self._peers):
            self._drop(key)
