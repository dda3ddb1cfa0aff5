"""The agent's Kubernetes side: publish this rank's KVEndpoint, follow its status.

Imported lazily: ``import kvbridge_agent`` never imports the ``kubernetes`` client (or
kopf); only using this package does.

- :class:`PodIdentity`: pod name/uid/namespace/node from the downward API env vars.
- :func:`endpoint_spec`: the KVEndpoint ``spec`` for an agent's registration.
- :class:`EndpointPublisher`: create or update the KVEndpoint (owned by the Pod), write the
  agent's own ``status.handshakes``.
- :class:`PodDuties`: what a pod runs beside its agent (metrics, the sync), started and
  stopped in one place.
- :class:`EndpointSync`: a thread that follows the KVEndpoint's status (the operator's
  assigned ``peers``), drives :meth:`AgentService.set_peers` and reports the results.
"""

from ._document import endpoint_spec
from ._duties import PodDuties
from ._identity import PodIdentity, api_client
from ._publisher import EndpointPublisher, PublishError
from ._sync import EndpointSync

__all__ = [
    "EndpointPublisher",
    "EndpointSync",
    "PodDuties",
    "PodIdentity",
    "PublishError",
    "api_client",
    "endpoint_spec",
]
