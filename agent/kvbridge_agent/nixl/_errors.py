"""Typed errors and failure results of the NIXL data plane.

NIXL reports problems by raising pybind exceptions named ``nixl<Something>Error`` that all
derive straight from ``Exception``; :func:`classify` turns them into a :class:`FailureCause`
so callers never match on NIXL class names or state strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "DataPlaneError",
    "FailureCause",
    "NixlCallError",
    "RemoteNotFoundError",
    "TransferFailure",
    "UnsupportedTransferError",
    "classify",
]


class DataPlaneError(RuntimeError):
    """Base class of the errors this package raises."""


class NixlCallError(DataPlaneError):
    """A NIXL call raised; ``cause`` classifies it, ``__cause__`` is the NIXL exception."""

    def __init__(self, message: str, cause: FailureCause) -> None:
        super().__init__(message)
        self.cause = cause


class RemoteNotFoundError(DataPlaneError, KeyError):
    """A request names a remote engine (or rank) that was never added or was removed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnsupportedTransferError(DataPlaneError, NotImplementedError):
    """The layouts of the two engines need a transfer mode the spec rejects (spec §4.2, §5)."""


class FailureCause(enum.Enum):
    """Why a transfer request failed. Values are stable strings for logs and metrics."""

    INVALID_REQUEST = "invalid_request"       # ids out of range, prefix mismatch: nothing posted
    UNKNOWN_REMOTE = "unknown_remote"         # remote engine/rank never added or removed
    UNSUPPORTED = "unsupported"               # layout combination the spec rejects
    SETUP = "setup"                           # NIXL refused to create/prepare the transfer
    REMOTE_DISCONNECT = "remote_disconnect"   # the peer died or closed its endpoint
    TIMEOUT = "timeout"                       # deadline passed with a part still in flight
    TRANSFER = "transfer"                     # any other error while posting or polling
    ZEROING = "zeroing"                       # read done, but zeroing unread pages failed
    CANCELLED = "cancelled"                   # the engine was closed with the request in flight


_DISCONNECT_NAMES = frozenset({"nixlRemoteDisconnectError"})


def classify(exc: BaseException, *, default: FailureCause) -> FailureCause:
    """Map a NIXL (or our) exception to a :class:`FailureCause`; ``default`` for the rest."""
    if isinstance(exc, NixlCallError):
        return exc.cause
    if type(exc).__name__ in _DISCONNECT_NAMES:
        return FailureCause.REMOTE_DISCONNECT
    return default


@dataclass(frozen=True)
class TransferFailure:
    """Terminal failure of one request: no completion notification was sent for it.

    Attributes:
        request_id: the engine-local request id given to ``start``.
        cause: the classified reason.
        message: one line naming what failed (part, memory types, NIXL error).
        error: the exception behind it, if any (a GeometryError for INVALID_REQUEST).
    """

    request_id: str
    cause: FailureCause
    message: str
    error: BaseException | None = None
