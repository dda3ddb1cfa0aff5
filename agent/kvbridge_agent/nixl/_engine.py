"""What the pull and push engines share: one local engine, its remote peers, and the
in-flight transfers they poll, wait on and cancel."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from .. import geometry as geo
from ._errors import FailureCause, RemoteNotFoundError, UnsupportedTransferError
from ._inflight import Result, TransferDone, TransferFailure, Transfers
from ._local import LocalEngine
from ._peers import RemotePeers

__all__ = ["PollResult", "TransferEngine"]


@dataclass(frozen=True)
class PollResult:
    """Requests that became terminal since the last :meth:`TransferEngine.poll`."""

    finished: tuple[TransferDone, ...] = ()
    failed: tuple[TransferFailure, ...] = ()

    @property
    def finished_ids(self) -> set[str]:
        return {r.request_id for r in self.finished}

    @property
    def failed_ids(self) -> set[str]:
        return {r.request_id for r in self.failed}


_NOTHING = PollResult()


class _Identified(Protocol):
    """What :meth:`TransferEngine._track` reads of a pull or push request."""

    @property
    def request_id(self) -> str: ...

    @property
    def timeout_s(self) -> float | None: ...


R = TypeVar("R", bound=_Identified)


class TransferEngine:
    """Base of :class:`PullEngine` and :class:`PushEngine`: requests are started by the
    subclass, then advanced by :meth:`poll` or :meth:`wait`, each reported exactly once."""

    def __init__(
        self,
        local: LocalEngine,
        *,
        timeout_s: float,
        coalesce: bool,
        clock: Callable[[], float] = time.monotonic,
        on_terminal: Callable[[str], None] | None = None,
    ) -> None:
        self.local = local
        self.agent = local.agent
        self.timeout_s = float(timeout_s)
        self.coalesce = bool(coalesce)
        self._clock = clock
        self.peers = RemotePeers(self.agent)
        self._transfers = Transfers(self.agent, clock=clock, on_terminal=on_terminal)

    def _track(self, req: R, start: Callable[[R, Any], None], what: str) -> None:
        """Track ``req`` (a request with ``request_id`` and ``timeout_s``) and run
        ``start(req, tracked)``; a setup error becomes the request's typed failure (reported
        by :meth:`poll`/:meth:`wait`), never an exception here.

        Raises:
            ValueError: ``req.request_id`` is already in flight.
        """
        timeout = self.timeout_s if req.timeout_s is None else float(req.timeout_s)
        tracked = self._transfers.begin(req.request_id, self._clock() + timeout)
        try:
            start(req, tracked)
        except geo.GeometryError as exc:
            self._transfers.fail(tracked, FailureCause.INVALID_REQUEST, str(exc), exc)
        except RemoteNotFoundError as exc:
            self._transfers.fail(tracked, FailureCause.UNKNOWN_REMOTE, str(exc), exc)
        except UnsupportedTransferError as exc:
            self._transfers.fail(tracked, FailureCause.UNSUPPORTED, str(exc), exc)
        except Exception as exc:
            self._transfers.fail_exc(tracked, exc, FailureCause.SETUP, f"setting up the {what}")
        self._transfers.seal(tracked)

    def poll(self) -> PollResult:
        """Non-blocking: advance every request; report those finished/failed since the last
        call (each exactly once)."""
        results = self._transfers.poll()
        if not results:           # most engine steps: nothing ended
            return _NOTHING
        return PollResult(
            finished=tuple(r for r in results if isinstance(r, TransferDone)),
            failed=tuple(r for r in results if isinstance(r, TransferFailure)))

    def wait(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Block until ``request_id`` is terminal or the deadline (then: TIMEOUT failure).

        Returns :class:`TransferDone` or :class:`TransferFailure`. Raises KeyError if the
        request is unknown or was already reported by :meth:`poll`.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        return self._transfers.wait(request_id, self._clock() + timeout)

    def in_flight(self) -> tuple[str, ...]:
        return self._transfers.active()

    def close(self) -> None:
        """Cancel in-flight requests (no notifications) and drop every remote."""
        self._transfers.close()
        self.peers.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
