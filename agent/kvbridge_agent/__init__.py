"""kvbridge agent: the in-pod library that registers KV caches with NIXL, speaks the vLLM
NIXL connector version-11 handshake and moves KV blocks between prefill and decode pods.

Pure modules (``geometry``, ``protocol``) import neither NIXL, ZMQ nor Kubernetes, so the
operator can reuse the same compatibility rules. Every error the agent raises on purpose
derives from :class:`~kvbridge_agent.errors.KVBridgeError`.
"""

__version__ = "0.1.0"
