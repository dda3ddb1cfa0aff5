"""Whether a pod may carry requests now: Ready and not terminating. Pure.

A verified pair stays verified until its KVEndpoints are collected, which happens only after
the pod object is gone (10-30 s after ``kubectl delete``, longer with a drain). Readiness and
the deletion timestamp say it earlier: the moment the API server marks a pod for deletion, or
its readiness probe fails, new requests must go elsewhere while the requests it holds finish.
The router keeps one small :class:`PodState` per pod of its namespace, not the pod object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TERMINATING = "terminating"
NOT_READY = "not Ready"
GONE = "gone"


@dataclass(frozen=True)
class PodState:
    """What routing needs of one pod."""

    ready: bool
    terminating: bool

    @property
    def unusable(self) -> str:
        """Why the pod takes no new request ("" when it may)."""
        if self.terminating:
            return TERMINATING
        return "" if self.ready else NOT_READY


def pod_state(pod: Mapping[str, Any]) -> PodState:
    """The state of ``pod``, a Pod as the API server serialises it (camelCase keys)."""
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodState(ready=ready, terminating=bool(meta.get("deletionTimestamp")))


def unusable_pods(pods: tuple[str, ...], states: Mapping[str, PodState] | None
                  ) -> dict[str, str]:  # fmt: skip
    """The pods of ``pods`` that take no new request, with why; none when ``states`` is None
    (the router cannot read pods: only the KVEndpoints decide)."""
    if states is None:
        return {}
    out: dict[str, str] = {}
    for name in pods:
        state = states.get(name)
        why = GONE if state is None else state.unusable
        if why:
            out[name] = why
    return out
