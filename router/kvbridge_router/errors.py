"""The router's errors: one base, :class:`RouterError`, under the agent's
:class:`~kvbridge_agent.errors.KVBridgeError`, so ``except RouterError`` catches any error the
router raises on purpose. Those that keep a built-in base callers caught before name it in
parentheses, so no existing ``except`` changes meaning::

    KVBridgeError                        kvbridge_agent.errors
    └── RouterError
        ├── Refusal                      the request cannot be served as asked: answered, never
        │                                retried (here)
        ├── UpstreamError                a prefill or decode failed before the first byte:
        │                                retried on another pair (here)
        ├── EngineRejection              the prefill's 4xx: the client's answer (here)
        ├── BodyError                    the request body cannot be taken (limits)
        ├── RequestError (ValueError)    the request cannot take the P/D path (flow)
        └── EventError (ValueError)      a message that is not a KV event batch (kv_events)

Pure: importing it loads no aiohttp.
"""

from __future__ import annotations

from kvbridge_agent.errors import KVBridgeError

__all__ = ["EngineRejection", "Refusal", "RouterError", "UpstreamError"]


class RouterError(KVBridgeError):
    """Base of every error the kvbridge router raises on purpose."""


class Refusal(RouterError):
    """The request cannot be served as asked (the sidecar's prefill header names no verified
    peer, say): answered with ``status`` and the message, never retried."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class UpstreamError(RouterError):
    """A prefill or decode failed before the client saw a byte; retried on another pair."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class EngineRejection(RouterError):
    """The prefill answered the client's request with a 4xx: the client's answer as it
    stands, never retried."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type
