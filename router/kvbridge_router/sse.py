"""Server-sent events as vLLM writes them (``data: <json>\\n\\n``, the last one
``data: [DONE]``): split from a byte stream, and written back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

DONE = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Event:
    #: the event as received, separator included (comments and unknown fields kept)
    raw: bytes
    #: its ``data`` lines joined, or None for an event without data (a keep-alive comment)
    data: str | None


class Parser:
    """Events out of chunks that split them anywhere."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[Event]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return
            raw, self._buffer = self._buffer[:end + 2], self._buffer[end + 2:]
            yield Event(raw, _data(raw))

    def rest(self) -> Event | None:
        """What is left without a closing blank line (a stream cut short), as an event."""
        raw, self._buffer = self._buffer, b""
        return Event(raw + b"\n\n", _data(raw)) if raw.strip() else None


def _data(raw: bytes) -> str | None:
    lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode(errors="replace") if lines else None


def event(data: bytes) -> bytes:
    """One ``data:`` event (JSON has no raw newline, so one line)."""
    return b"data: " + data + b"\n\n"


def ends_with_done(tail: bytes) -> bool:
    """Whether a stream whose last bytes are ``tail`` has delivered its ``[DONE]`` event."""
    return tail.replace(b"\r\n", b"\n").rstrip(b"\n").endswith(b"data: [DONE]")
