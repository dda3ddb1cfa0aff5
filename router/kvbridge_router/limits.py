"""The front door's limits on a request body: its size, the time to read it, its media type
and its nesting, each answered with a status of its own instead of a held connection or a 500.

- A declared ``Content-Length`` above the limit is refused at once (413), before a byte of the
  body is read; a body without one that grows past it is refused when it does.
- The whole body must arrive within a time limit (408): a client that declares a length and
  stalls holds no handler for longer.
- The media type must be ``application/json``, as vLLM 0.30.0 requires of its OpenAI routes
  (``validate_json_request``): a JSON body sent as ``text/plain`` or without a content type
  gets the engine's own 400, word for word, so that a client that works against the router
  works against the engine, and the other way round.
- A body that is no JSON object gets vLLM's 400 for it, as its FastAPI server words it: a
  pydantic validation error for invalid JSON, an empty body or another JSON value, and
  FastAPI's own ``{"detail": "There was an error parsing the body"}`` for JSON nested deeper
  than the parser's recursion limit (which reached aiohttp as a 500 before). The messages
  are rebuilt from the standard library's JSON parser, the one FastAPI uses; vLLM's
  scrubbing of file paths out of messages is not repeated.

The time to send the request line and headers is bounded by aiohttp itself (see
``RouterSettings.header_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from aiohttp import web

from .client_errors import error_body
from .errors import RouterError

JSON_MEDIA_TYPE = "application/json"
#: vLLM 0.30.0's answer to another media type (its RequestValidationError handler's words)
MEDIA_TYPE_MESSAGE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' " \
    "is allowed"
#: FastAPI's answer (vLLM's server) to a body its JSON parser gives up on
PARSE_MESSAGE = "There was an error parsing the body"
#: how much of a refused value vLLM's validation errors show
MAX_INPUT_CHARS = 200

_decode_json = msgspec.json.Decoder().decode


class BodyError(RouterError):
    """The body cannot be taken: answered with ``status`` and ``body``; ``close`` when the
    connection must close after the answer (its body was not read to the end)."""

    def __init__(self, status: int, body: dict[str, Any], close: bool = False) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body, self.close = status, body, close


def json_media_type(content_type: str) -> bool:
    """vLLM's test of the ``Content-Type`` header (no header: not JSON)."""
    return content_type.lower().split(";", maxsplit=1)[0] == JSON_MEDIA_TYPE


def parse_json(raw: bytes) -> dict[str, Any]:
    """The decoded body, a JSON object; BodyError (400) otherwise, as vLLM answers it."""
    try:
        body = _decode_json(raw) if raw else None
    except msgspec.DecodeError:
        body = _python_json(raw)
    except RecursionError as exc:
        raise BodyError(400, {"detail": PARSE_MESSAGE}) from exc
    if body is None:
        raise BodyError(400, _validation_error(
            {"type": "missing", "loc": "body", "msg": "Field required", "input": "None"}))
    if not isinstance(body, dict):
        raise BodyError(400, _validation_error(
            {"type": "model_attributes_type", "loc": "body",
             "msg": "Input should be a valid dictionary or object to extract fields from",
             "input": _summary(body)}))  # fmt: skip
    return body


def _python_json(raw: bytes) -> Any:
    """What the standard parser says of a body msgspec refused: the errors FastAPI gives."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BodyError(400, _validation_error(
            {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
             "input": "<dict of 0 items>", "ctx": {"error": exc.msg}})) from exc
    except (RecursionError, ValueError) as exc:
        raise BodyError(400, {"detail": PARSE_MESSAGE}) from exc
    # Python also reads NaN, Infinity and unpaired surrogates, which do not survive the
    # re-encoding to the engines.
    raise BodyError(400, error_body("request body: JSON with NaN, Infinity or an unpaired "
                                    "surrogate", "Bad Request", 400))  # fmt: skip


def _validation_error(error: dict[str, Any]) -> dict[str, Any]:
    """vLLM's answer to one pydantic validation error (its RequestValidationError handler)."""
    return error_body(f"1 validation error:\n  {error}", "Bad Request", 400, error["loc"])


def _summary(value: Any) -> str:
    """A value as vLLM's validation handler shows it (``_summarize_error_input``)."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_INPUT_CHARS] + "...[truncated]" if len(text) > MAX_INPUT_CHARS else text


async def read_json(request: web.Request, max_bytes: int, timeout_s: float) -> Any:
    """The request's JSON body within the limits above; BodyError otherwise."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise BodyError(413, _too_large(declared, max_bytes), close=True)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError as exc:
        raise BodyError(408, error_body(
            f"request body: not received within {timeout_s:g} s", "request_timeout", 408),
            close=True) from exc  # fmt: skip
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyError(413, _too_large(None, max_bytes), close=True) from exc
    if not json_media_type(request.headers.get("Content-Type", "")):
        # Read first, as vLLM does: the connection stays usable for the client's next request.
        raise BodyError(400, error_body(MEDIA_TYPE_MESSAGE, "Bad Request", 400))
    return parse_json(raw)


def _too_large(declared: int | None, max_bytes: int) -> dict[str, Any]:
    size = f"{declared} bytes" if declared is not None else "larger"
    return error_body(f"request body: {size}, over the limit of {max_bytes} bytes",
                      "request_too_large", 413)  # fmt: skip
