"""Error answers as the client should see them: vLLM's error shape, and a prefill's 4xx said
of the client's own request instead of the rewritten one the prefill received.

vLLM 0.30.0 answers a client error with ``{"error": {"message", "type", "param", "code"}}``
(``ErrorResponse``). A 4xx from an engine is the client's answer and passes through as the
engine wrote it, except for what would expose the P/D rewrite: the prefill is asked for one
output token (flow.py), so when a prompt is too long for the context, vLLM's message says
"you requested 1 output tokens" and counts the prompt against ``max_model_len - 1``. Those two
messages (``TokenizeParams._token_len_check`` and ``_text_len_check`` in
``vllm/renderers/params.py``) are re-derived here for the client's own ``max_tokens``, with
the numbers vLLM would print for it:

- the token check: a text prompt (completions, or chat's rendered template) is tokenized
  with truncation at ``max_input_tokens + 1`` tokens, so the count vLLM prints for the
  client is ``max_model_len - max_tokens + 1`` "at least"; a prompt of token ids is never
  truncated, so its count is the prefill's, exact;
- the character check (a prompt longer than ``max_input_tokens * max_chars_per_token``
  characters, refused before tokenizing): the bound is the client's ``max_input_tokens``
  times the prefill's characters per token;
- a client ``max_tokens`` above ``max_model_len`` is what vLLM refuses first, in
  ``TokenizeParams.__post_init__``; that message is given instead.

And a pydantic validation error about the body as a whole (a required field missing, say)
shows it as ``'input': '<dict of N items>'``: N is said of the client's body, not of the
prefill's, which has the router's keys added.

Limits, where the prefill's answer does not tell: with no output-token limit at all (chat
without ``max_tokens``; 0 output tokens) a text prompt the prefill found "at least
``max_model_len``" tokens long is assumed longer than the context, and a client
``max_tokens`` that is not an integer leaves the message as the prefill wrote it.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from .flow import CHAT, COMPLETIONS, prefill_request

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

#: vLLM 0.30.0's default ``max_tokens`` of a completion request (CompletionRequest)
COMPLETION_DEFAULT_MAX_TOKENS = 16

_TOKENS = re.compile(
    r"This model's maximum context length is (?P<total>\d+) tokens\. However, you requested "
    r"(?P<out>-?\d+) output tokens and your prompt contains (?P<least>at least )?(?P<count>\d+) "
    r"input tokens, for a total of (?:at least )?\d+ tokens\. Please reduce the length of the "
    r"input prompt or the number of requested output tokens\. "
    r"\(parameter=input_tokens, value=\d+\)")  # fmt: skip
_CHARS = re.compile(
    r"This model's maximum context length is (?P<total>\d+) tokens\. However, you requested "
    r"(?P<out>-?\d+) output tokens and your prompt contains (?P<chars>\d+) characters \(more "
    r"than (?P<bound>\d+) characters, which is the upper bound for (?P<inputs>-?\d+) input "
    r"tokens\)\. Please reduce the length of the input prompt or the number of requested "
    r"output tokens\. \(parameter=input_text, value=\d+\)")  # fmt: skip
_REDUCE = "Please reduce the length of the input prompt or the number of requested output tokens."
#: a validation error whose input is the whole body (vLLM's handler summarizes it by size)
_WHOLE_BODY = re.compile(r"""('loc': 'body(?:\.\w+)?', 'msg': (?:'[^']*'|"[^"]*"), """
                         r"""'input': '<dict of )(\d+)( items>')""")


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape, so that a client parses the router's errors as the engine's."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def output_tokens(path: str, body: dict[str, Any]) -> tuple[int, str] | None:
    """The client's requested output tokens as vLLM 0.30.0 counts them against the context
    (``build_tok_params``: chat's ``max_completion_tokens`` before ``max_tokens``; none is
    0), and the parameter that set them; None when that value is not an integer."""
    if path == CHAT:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        value = body.get(param)
    else:       # null is the default too (normalize_null_max_tokens)
        param = "max_tokens"
        value = body.get(param)
        value = COMPLETION_DEFAULT_MAX_TOKENS if value is None else value
    if value is None:
        return 0, param
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value, param


def prefill_rejection(path: str, client_body: dict[str, Any], raw: bytes,
                      prefill_tokens: int = 1) -> bytes:  # fmt: skip
    """The prefill's 4xx body ``raw`` as the client's answer: the message re-derived for the
    client's request where it describes the prefill's ``prefill_tokens`` output tokens,
    otherwise unchanged (see the module docstring)."""
    try:
        answer = _decode(raw)
        error = answer["error"]
        message = error["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return raw
    if not isinstance(message, str):
        return raw
    wanted = output_tokens(path, client_body)
    rewritten = None if wanted is None else _client_message(
        message, *wanted, _token_prompt(path, client_body), prefill_tokens)
    if rewritten is not None:
        error["message"], error["param"] = rewritten
        return _encode(answer)
    sizes = _body_sizes(message, _keys_seen(path, prefill_request(path, client_body)),
                        _keys_seen(path, client_body))  # fmt: skip
    if sizes == message:
        return raw
    error["message"] = sizes
    return _encode(answer)


def _keys_seen(path: str, body: dict[str, Any]) -> int:
    """The body's size as vLLM's validators see it (completions add a missing max_tokens)."""
    return len(body) + (path == COMPLETIONS and "max_tokens" not in body)


def _body_sizes(message: str, sent: int, client: int) -> str:
    if sent == client:
        return message
    return _WHOLE_BODY.sub(lambda m: f"{m[1]}{client}{m[3]}" if int(m[2]) == sent else m[0],
                           message)  # fmt: skip


def _token_prompt(path: str, body: dict[str, Any]) -> bool:
    """Whether the prompt is token ids (vLLM never truncates those while counting them)."""
    prompt = body.get("prompt")
    return path != CHAT and isinstance(prompt, list) and bool(prompt) \
        and all(isinstance(t, int) for t in prompt)


def _client_message(message: str, tokens: int, param: str, token_prompt: bool,
                    prefill_tokens: int) -> tuple[str, str] | None:  # fmt: skip
    """(message, param) vLLM would answer for ``tokens`` output tokens, or None when
    ``message`` is not one of the context-length messages about the prefill's request."""
    match = _TOKENS.fullmatch(message) or _CHARS.fullmatch(message)
    if match is None or int(match["out"]) != prefill_tokens:
        return None
    total = int(match["total"])
    if tokens > total:
        return (f"{param}={tokens} cannot be greater than max_model_len=max_total_tokens="
                f"{total}. Please request fewer output tokens. "
                f"(parameter={param}, value={tokens})", param)
    inputs = total - tokens
    if match.re is _CHARS:
        per_token, remainder = divmod(int(match["bound"]), int(match["inputs"]) or 1)
        chars, bound = int(match["chars"]), inputs * per_token
        if remainder == 0 and chars > bound:
            return (f"This model's maximum context length is {total} tokens. However, you "
                    f"requested {tokens} output tokens and your prompt contains {chars} "
                    f"characters (more than {bound} characters, which is the upper bound for "
                    f"{inputs} input tokens). {_REDUCE} (parameter=input_text, value={chars})",
                    "input_text")
        count = inputs + 1      # more characters than the prefill allowed: many tokens
    elif token_prompt or not match["least"]:
        count = int(match["count"])     # counted exactly
    else:
        count = inputs + 1      # truncated at the client's max_input_tokens + 1
    if count <= inputs:
        return None
    least = "at least " if count == inputs + 1 else ""
    return (f"This model's maximum context length is {total} tokens. However, you requested "
            f"{tokens} output tokens and your prompt contains {least}{count} input tokens, "
            f"for a total of {least}{count + tokens} tokens. {_REDUCE} "
            f"(parameter=input_tokens, value={count})", "input_tokens")
