"""Wire formats of the NIXL notifications that go with a transfer (spec §1.8).

* completion, D -> P (pull) or P -> D (push): ASCII ``"{request_id}:{consumers}"``;
* heartbeat, D -> P: ``"HB:" + ",".join(request_ids)``.

Request ids may themselves contain ``":"``; the count is after the *last* colon.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KVBridgeError

__all__ = [
    "HEARTBEAT_PREFIX",
    "Completion",
    "Heartbeat",
    "NotificationError",
    "completion_message",
    "heartbeat_message",
    "parse_notification",
]

HEARTBEAT_PREFIX = "HB:"


class NotificationError(KVBridgeError, ValueError):
    """A notification that is neither a completion nor a heartbeat."""


@dataclass(frozen=True)
class Completion:
    request_id: str
    consumers: int


@dataclass(frozen=True)
class Heartbeat:
    request_ids: tuple[str, ...]


def completion_message(request_id: str, consumers: int) -> bytes:
    """``b"{request_id}:{consumers}"``; consumers = how many readers will notify this rank."""
    if consumers < 1:
        raise ValueError(f"consumers: expected >= 1, got {consumers}")
    return f"{request_id}:{int(consumers)}".encode()


def heartbeat_message(request_ids: list[str] | tuple[str, ...]) -> bytes:
    """``b"HB:id1,id2"`` for the given (non-empty) request ids."""
    if not request_ids:
        raise ValueError("heartbeat_message: expected at least one request id")
    return (HEARTBEAT_PREFIX + ",".join(request_ids)).encode()


def parse_notification(message: bytes | str) -> Completion | Heartbeat:
    """Parse one notification.

    Raises:
        NotificationError: not UTF-8, no ``":count"`` suffix, or a count that is not a
            positive integer (the message is quoted in the error).
    """
    try:
        text = message.decode() if isinstance(message, bytes | bytearray) else str(message)
    except UnicodeDecodeError as exc:
        raise NotificationError(f"notification {message!r}: not UTF-8") from exc
    if text.startswith(HEARTBEAT_PREFIX):
        ids = tuple(i for i in text[len(HEARTBEAT_PREFIX):].split(",") if i)
        return Heartbeat(ids)
    request_id, sep, count = text.rpartition(":")
    if not sep or not request_id:
        raise NotificationError(
            f"notification {text!r}: expected '<request_id>:<consumers>' or 'HB:<ids>'"
        )
    try:
        consumers = int(count)
    except ValueError:
        consumers = 0
    if consumers < 1:
        raise NotificationError(
            f"notification {text!r}: consumer count {count!r} is not a positive integer"
        )
    return Completion(request_id, consumers)
