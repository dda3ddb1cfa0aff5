"""What a pod runs beside its agent: the ``/metrics`` server and the KVEndpoint sync.

The vLLM worker, :func:`~kvbridge_agent.vllm.start_agent` and the demo's pod agent all start
these through :meth:`PodDuties.start` and end them with :meth:`PodDuties.stop`, so a pod's
duties are written once. The metrics registry is process-wide, so its server lives until the
process ends; :meth:`PodDuties.stop` ends the sync (and with it the agent's ``info`` series).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import metrics
from ._publisher import EndpointPublisher
from ._sync import EndpointSync

if TYPE_CHECKING:
    from ..identity import ModelIdentity

__all__ = ["PodDuties"]

log = logging.getLogger("kvbridge.agent.kube")


class PodDuties:
    """A started agent's metrics port (or None) and KVEndpoint sync (or None)."""

    def __init__(self, metrics_port: int | None = None, sync: EndpointSync | None = None
                 ) -> None:
        self.metrics_port = metrics_port
        self.sync = sync

    @classmethod
    def start(cls, service: Any, *, metrics_port: int | None = None,
              metrics_addr: str = "0.0.0.0", publisher: EndpointPublisher | None = None,
              transfer: str = "", sync_interval_s: float = 1.0,
              identity: ModelIdentity | None = None) -> PodDuties:
        """Serve metrics on ``metrics_port`` (None: none, 0: a free port) and, given a
        ``publisher``, publish ``service``'s KVEndpoint for ``transfer`` (with the model
        ``identity``, when given) and follow it.
        On failure whatever started is stopped again; ``service`` is the caller's."""
        duties = cls()
        try:
            if metrics_port is not None:
                duties.metrics_port = metrics.serve(metrics_port, metrics_addr)
                log.info("kvbridge agent metrics on port %d", duties.metrics_port)
            if publisher is not None:
                duties.sync = EndpointSync(service, publisher, transfer,
                                           interval_s=sync_interval_s,
                                           identity=identity).start()
        except BaseException:
            duties.stop()
            raise
        return duties

    def stop(self) -> None:
        """Stop following the KVEndpoint (idempotent)."""
        if self.sync is not None:
            self.sync.stop()
            self.sync = None
