"""Typed errors and failure results of the NIXL data plane.

NIXL reports problems by raising pybind exceptions named ``nixl<Something>Error`` that all
derive straight from ``Exception``; :func:`classify` turns them into a :class:`FailureCause`
so callers never match on NIXL class names or state strings; :func:`nixl_call` and
:func:`call_error` are the one place NIXL exceptions become :class:`NixlCallError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import KVBridgeError

__all__ = [
    "CallDetail",
    "DataPlaneError",
    "FailureCause",
    "NixlCallError",
    "RemoteNotFoundError",
    "TransferFailure",
    "UnsupportedTransferError",
    "call_error",
    "classify",
    "nixl_call",
]


class DataPlaneError(KVBridgeError, RuntimeError):
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


# -- the translation boundary: NIXL exceptions in, typed errors out -----------------------


class CallDetail:
    """What a transfer call was about, formatted only for an error message."""

    __slots__ = ("descs", "label", "op")

    def __init__(self, op: str, label: str, descs: int) -> None:
        self.op, self.label, self.descs = op, label, descs

    def __str__(self) -> str:
        return f"{self.op} {self.label}, {self.descs} descs"


class nixl_call:
    """``with nixl_call(what, cause):`` turns an exception from NIXL into a typed
    :class:`NixlCallError` (our own errors pass through). A class rather than a
    ``contextlib`` generator: it wraps every call on a transfer's path."""

    __slots__ = ("default", "detail", "what")

    def __init__(self, what: str, default: FailureCause, detail: object = None) -> None:
        # ``detail`` is formatted only on failure: hot calls pass their label unformatted
        self.what, self.default, self.detail = what, default, detail

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, DataPlaneError) or not isinstance(exc, Exception):
            return False
        raise call_error(exc, self.what, self.default, self.detail) from exc


def call_error(exc: BaseException, what: str, default: FailureCause, detail: object = None
               ) -> NixlCallError:
    """The typed error for ``exc`` raised by the NIXL call ``what`` (the per-transfer calls
    use it from a plain ``except``: no context object on their path)."""
    what = what if detail is None else f"{what}({detail})"
    return NixlCallError(f"{what}: {type(exc).__name__}: {exc}", classify(exc, default=default))
