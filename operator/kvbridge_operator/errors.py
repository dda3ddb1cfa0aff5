"""Operator errors. Handlers map them to kopf errors; nothing else imports kopf for them.

Every error the operator raises on purpose derives from :class:`OperatorError`, itself a
:class:`~kvbridge_agent.errors.KVBridgeError`, and keeps the built-in base callers caught
before (in parentheses), so ``except OperatorError`` catches any of them and no existing
``except`` changes meaning::

    KVBridgeError                          kvbridge_agent.errors
    └── OperatorError
        ├── SpecError (ValueError)         a custom resource field is malformed (here)
        ├── UnboundedError (ValueError)    a CRD schema field has no bound (limits)
        ├── KubeError (RuntimeError)       a Kubernetes API call failed (kube)
        │   └── KubeUnavailable            ... without an answer: try again later
        ├── NotLeading                     a write by a replica not holding the Lease (kube)
        └── ReleaseDeferred                a deleted KVTransfer's release waits (reconciler)
"""

from __future__ import annotations

from kvbridge_agent.errors import KVBridgeError

__all__ = ["OperatorError", "SpecError"]


class OperatorError(KVBridgeError):
    """Base of every error the kvbridge operator raises on purpose."""


class SpecError(OperatorError, ValueError):
    """A custom resource field is malformed: ``path`` names it, the message says what to do."""

    def __init__(self, path: str, expected: str, actual: object) -> None:
        super().__init__(f"{path}: expected {expected}, got {actual!r}")
        self.path = path
        self.expected = expected
        self.actual = actual
