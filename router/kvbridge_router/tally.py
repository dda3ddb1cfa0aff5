"""Every request counted once in ``kvbridge_router_requests_total``, however its handler ends.

A client that goes away cancels its handler (``handler_cancellation``; the ``openai`` client
closes the connection right after ``data: [DONE]``), so a count made after the last write
can be skipped. Instead the handler opens a :class:`Tally` when it starts, the request's
steps settle its outcome as they learn it, and the tally is counted when the handler ends,
cancelled or not: ``cancelled`` until something else is known (``failed`` if the handler
dies of an error of the router's own), ``answered`` as soon as a stream's ``[DONE]`` went
out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from . import metrics as m
from .balance import Pair

CANCELLED = "cancelled"
FAILED = "failed"

_CURRENT: ContextVar[Tally | None] = ContextVar("kvbridge_router_tally", default=None)


class Tally:
    __slots__ = ("_counted", "outcome", "pair")

    def __init__(self) -> None:
        self.outcome, self.pair, self._counted = CANCELLED, None, False

    def settle(self, outcome: str, pair: Pair | None = None) -> None:
        self.outcome = outcome
        if pair is not None:
            self.pair = pair

    def count(self) -> None:
        if self._counted:
            return
        self._counted = True
        count(self.outcome, self.pair)

    def drop(self) -> None:
        """Not counted here: the caller counts the request its own way."""
        self._counted = True


def count(outcome: str, pair: Pair | None) -> None:
    m.REQUESTS.labels(outcome, *m.pair_labels(pair)).inc()


def record(outcome: str, pair: Pair | None) -> None:
    """Settle the handler's open tally (counted when the handler ends), or count at once
    when none is open."""
    current = _CURRENT.get()
    if current is None:
        count(outcome, pair)
    else:
        current.settle(outcome, pair)


def current() -> Tally | None:
    """The tally of the request being handled in this task, if one is open."""
    return _CURRENT.get()


@contextlib.contextmanager
def opened(drop_on: type[BaseException] | tuple[type[BaseException], ...] = ()
           ) -> Iterator[Tally]:  # fmt: skip
    """A tally for the handler's request, counted on the way out (the one already open, if
    any, is left to its opener); an exception of ``drop_on`` leaves it uncounted."""
    existing = _CURRENT.get()
    if existing is not None:
        yield existing
        return
    tally = Tally()
    token = _CURRENT.set(tally)
    try:
        yield tally
    except drop_on:
        tally.drop()
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise       # the client went away
    except Exception:
        if tally.outcome == CANCELLED:
            tally.settle(FAILED)    # the router's own error: aiohttp answers a 500
        raise
    finally:
        _CURRENT.reset(token)
        tally.count()
