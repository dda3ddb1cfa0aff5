"""The operator's process state in one object, handed to every handler as kopf's memo.

Settings are read once (:func:`settings`), at import: they decide which admission handlers
exist. The rest is made by the startup handler: the Kubernetes writer, the planning loops
(each KVTransfer's wake-up event and write memory) and the node labels and readiness last
seen, which the TopologyAware policy and node-loss handling follow. Handlers take it from
``memo.runtime``; nothing else in the operator keeps state between calls (the Prometheus
metrics aside).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from .config import Settings
from .kube import Kube
from .leader import LeaderElector
from .reconciler import PlanningLoops

__all__ = ["Runtime", "from_memo", "settings"]


@functools.cache
def settings() -> Settings:
    """The operator's settings, read from its environment once per process."""
    return Settings.from_env()


@dataclass
class Runtime:
    """What the handlers share: settings, the writer, the Lease loop, the planning loops,
    node labels."""

    settings: Settings
    kube: Kube
    #: the Lease loop (None: leader election off, this replica always acts)
    leader: LeaderElector | None = None
    loops: PlanningLoops = field(default_factory=PlanningLoops)
    #: node name -> (labels, lost) as last seen (a deleted node is forgotten)
    nodes: dict[str, tuple[dict[str, str], bool]] = field(default_factory=dict)

    def tracked(self) -> dict[str, int]:
        """Sizes of the bookkeeping, for ``kvbridge_tracked_objects``."""
        return {**self.loops.tracked(), "nodes": len(self.nodes)}

    def node_changed(self, name: str, labels: dict[str, str] | None, lost: bool = False
                     ) -> bool:  # fmt: skip
        """Record node ``name``'s labels (None: deleted) and whether it is lost (its Ready
        condition not True); True when a known node's labels or readiness changed or it went
        away, which re-plans every KVTransfer."""
        seen = self.nodes.get(name)
        if labels is None:
            self.nodes.pop(name, None)
            return seen is not None
        self.nodes[name] = (labels, lost)
        return seen is not None and seen != (labels, lost)


def from_memo(memo: Any) -> Runtime:
    """The runtime kopf carries in ``memo`` (set by the startup handler)."""
    runtime = getattr(memo, "runtime", None)
    if runtime is None:
        raise RuntimeError("kvbridge operator runtime missing from kopf's memo: the startup "
                           "handler has not run")
    return runtime
