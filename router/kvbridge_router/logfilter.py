"""Malformed requests logged briefly: aiohttp logs a client's unparsable request line or
headers at ERROR with a traceback (``RequestHandler.handle_error``, logger ``aiohttp.server``),
so on a public port any scanner fills the log with tracebacks of the client's mistake. Such
a record becomes one WARNING line, at most one per interval; the ones left out in between
are counted in the next."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"
MAX_DETAIL = 200


class MalformedRequests(logging.Filter):
    def __init__(self, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._next = float("-inf")
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or not isinstance(exc, HttpProcessingError):
            return True
        now = self.clock()
        if now < self._next:
            self._left_out += 1
            return False
        self._next = now + self.interval_s
        left_out, self._left_out = self._left_out, 0
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        detail = " ".join(str(exc.message).split())[:MAX_DETAIL]
        record.msg = "malformed request from %s: HTTP %s, %s%s"
        record.args = (remote, exc.code, detail,
                       f" ({left_out} more since the last report)" if left_out else "")
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def install(interval_s: float = 10.0) -> MalformedRequests:
    """The filter on aiohttp's server logger, once per process."""
    logger = logging.getLogger(SERVER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, MalformedRequests):
            return existing
    installed = MalformedRequests(interval_s)
    logger.addFilter(installed)
    return installed
