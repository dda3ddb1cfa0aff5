"""The router's OpenAI surface held to a vLLM engine's, case by case: the request shapes and
client errors a front must answer as the engine does, and :func:`compare`, which sends a case
to the front and to one engine directly and asserts that a client could not tell the two
answers apart. A helper for test_router_engines.py (real engines behind ``kvbridge-router``,
started with ``--max-model-len 1024`` and the tiny test model); no tests here::

    @pytest.mark.parametrize("case", openai_surface.CASES, ids=lambda c: c.name)
    def test_...(serving, case):
        openai_surface.compare(serving.router, serving.engines["decode-0"].url, case)

Expected answers are always the engine's, never written down here. Compared: the status;
for an error, the whole error object (message included: the router's errors are said of the
client's own request, as the engine says them); for an answer, its top-level keys, each
choice's index and keys, and usage's token counts; for a stream, the kinds of its events in
order (chunks, usage, error, ``[DONE]``), the chunks' keys, and per choice index its role and
last ``finish_reason``. For greedy cases (temperature 0, ``ignore_eos``) also each choice's
text and token ids. Not compared: ids, timestamps, usage's cache details, the value of
``kv_transfer_params`` (the engine asked directly has none), how a stream is cut into chunks
and how the choices of a batch interleave.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge_testkit.vllm_pods import MODEL, WORDS

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 8
#: words enough for well over the engines' 1024-token context, in fewer characters than
#: vLLM's character bound (so its token count is what refuses it)
LONG_PROMPT = " ".join(WORDS[i % len(WORDS)] for i in range(500))
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    #: the JSON body, or a function making the raw bytes sent instead
    body: dict[str, Any] | Callable[[], bytes]
    stream: bool = False
    #: None: no Content-Type header at all
    content_type: str | None = "application/json"
    #: temperature 0 and ignore_eos: the same tokens are expected from both
    greedy: bool = True
    #: refused by the decode after the prefill took it: through the router, the prefill
    #: keeps the prompt's blocks until its lease ends (no request ever read or freed them),
    #: which a test measuring the prefill's KV usage must allow for
    holds_prefill_blocks: bool = False

    def payload(self) -> bytes:
        return self.body() if callable(self.body) else json.dumps(self.body).encode()


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def _ten_megabytes() -> bytes:
    return json.dumps(completion("x" * 10_000_000)).encode()


def _nested() -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "x": ' + b"[" * 100_000 \
        + b"]" * 100_000 + b"}"


PROMPT = " ".join(WORDS[:12])
STREAM = {"stream": True}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}
SAMPLED = {"temperature": 1.0, "seed": 7}
BATCH = [" ".join(WORDS[i:i + 8]) for i in (0, 5, 11)]
TOKEN_BATCH = [list(range(10, 40)), list(range(60, 75))]

CASES: list[Case] = [
    Case("completion", COMPLETIONS, completion(PROMPT)),
    Case("completion-stream", COMPLETIONS, completion(PROMPT, **STREAM), stream=True),
    Case("completion-stream-usage", COMPLETIONS, completion(PROMPT, **USAGE), stream=True),
    Case("chat", CHAT, chat(PROMPT)),
    Case("chat-stream-usage", CHAT, chat(PROMPT, **USAGE), stream=True),
    Case("list-of-one-prompt", COMPLETIONS, completion([PROMPT])),
    Case("list-of-prompts", COMPLETIONS, completion(BATCH)),
    Case("list-of-prompts-stream", COMPLETIONS, completion(BATCH, **USAGE), stream=True),
    Case("token-prompts", COMPLETIONS, completion(TOKEN_BATCH)),
    Case("token-prompts-stream", COMPLETIONS, completion(TOKEN_BATCH, **STREAM), stream=True),
    Case("n2-greedy", COMPLETIONS, completion(PROMPT, n=2)),
    Case("n2-greedy-chat-stream", CHAT, chat(PROMPT, n=2, **STREAM), stream=True),
    Case("n2-sampled", COMPLETIONS, completion(PROMPT, n=2, **SAMPLED), greedy=False),
    Case("n2-sampled-batch-stream", COMPLETIONS, completion(BATCH[:2], n=2, **SAMPLED, **USAGE),
         stream=True, greedy=False),
    Case("n2-sampled-chat", CHAT, chat(PROMPT, n=2, **SAMPLED), greedy=False),
    Case("n2-sampled-chat-stream", CHAT, chat(PROMPT, n=2, **SAMPLED, **USAGE), stream=True,
         greedy=False),
    Case("unknown-model", COMPLETIONS, completion(PROMPT, model="no-such-model")),
    Case("unknown-model-chat", CHAT, chat(PROMPT, model="no-such-model")),
    Case("negative-temperature", COMPLETIONS, completion(PROMPT, temperature=-1)),
    Case("negative-temperature-chat-stream", CHAT, chat(PROMPT, temperature=-1, **STREAM),
         stream=True),
    Case("prompt-over-the-context", COMPLETIONS, completion(LONG_PROMPT)),
    Case("prompt-over-the-context-stream", COMPLETIONS, completion(LONG_PROMPT, **STREAM),
         stream=True),
    Case("prompt-over-the-context-chat", CHAT, chat(LONG_PROMPT)),
    Case("prompt-over-the-context-no-limit-chat", CHAT, chat(LONG_PROMPT, max_tokens=None)),
    Case("prompt-over-the-context-chat-completion-tokens", CHAT,
         chat(LONG_PROMPT, max_tokens=None, max_completion_tokens=5)),
    Case("prompt-over-the-context-max-tokens-null", COMPLETIONS,
         completion(LONG_PROMPT, max_tokens=None)),
    Case("prompt-over-the-context-in-a-batch", COMPLETIONS, completion([PROMPT, LONG_PROMPT])),
    Case("messages-missing", CHAT, {"model": MODEL, "max_tokens": MAX_TOKENS}),
    Case("max-tokens-over-the-context", COMPLETIONS, completion(PROMPT, max_tokens=2000),
         holds_prefill_blocks=True),
    Case("json-as-text-plain", COMPLETIONS, completion(PROMPT), content_type="text/plain"),
    Case("json-without-content-type", COMPLETIONS, completion(PROMPT), content_type=None),
    Case("invalid-json", COMPLETIONS, lambda: b'{"model": "' + MODEL.encode() + b'", '),
    Case("empty-body", COMPLETIONS, lambda: b""),
    Case("json-array-body", CHAT, lambda: b"[1, 2]"),
    Case("ten-megabyte-body", COMPLETIONS, _ten_megabytes),
    Case("deeply-nested-json", COMPLETIONS, _nested),
]


# -- sending -------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    content_type: str
    data: bytes
    events: list[Any] = field(default_factory=list)

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def json(self) -> Any:
        return json.loads(self.data)

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.content_type}: {self.data[:400]!r}"


def send(base_url: str, case: Case) -> Reply:
    """The case's request, and the whole reply (a stream read to its end)."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=TIMEOUT_S)
    headers = {} if case.content_type is None else {"Content-Type": case.content_type}
    try:
        conn.request("POST", case.path, body=case.payload(), headers=headers)
        reply = conn.getresponse()
        out = Reply(reply.status, reply.getheader("Content-Type") or "", reply.read())
    finally:
        conn.close()
    if out.streamed:
        out.events = events(out.data)
    return out


def events(data: bytes) -> list[Any]:
    """A stream's ``data:`` events: decoded JSON, or the string ``[DONE]``."""
    out = []
    for block in data.decode().replace("\r\n", "\n").split("\n\n"):
        lines = [line[5:].removeprefix(" ") for line in block.split("\n")
                 if line.startswith("data:")]  # fmt: skip
        if lines:
            payload = "\n".join(lines)
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# -- comparing -----------------------------------------------------------------------------
def compare(front_url: str, engine_url: str, case: Case) -> None:
    """Assert that ``case`` gets from the front what it gets from the engine (see the module
    docstring for what is compared)."""
    front, engine = send(front_url, case), send(engine_url, case)
    where = f"{case.name}:\n  front  {front}\n  engine {engine}"
    assert front.status == engine.status, where
    assert front.streamed == engine.streamed == (case.stream and engine.status == 200), where
    if engine.status >= 400:
        assert front.json() == engine.json(), where
    elif engine.streamed:
        _same_streams(front.events, engine.events, case.greedy, where)
    else:
        _same_answers(front.json(), engine.json(), case.greedy, where)


USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
#: what a choice says per token, compared for greedy cases
GENERATED = ("text", "token_ids", "prompt_token_ids", "message", "finish_reason")


def _same_answers(front: dict[str, Any], engine: dict[str, Any], greedy: bool,
                  where: str) -> None:  # fmt: skip
    assert set(front) == set(engine), where
    assert _usage(front) == _usage(engine), where
    assert _indices(front) == _indices(engine), where
    for mine, theirs in zip(front["choices"], engine["choices"], strict=True):
        assert set(mine) == set(theirs), where
        if greedy:
            assert {k: mine.get(k) for k in GENERATED} == {k: theirs.get(k) for k in GENERATED}, \
                where
    if greedy and "prompt_token_ids" in engine:
        assert front["prompt_token_ids"] == engine["prompt_token_ids"], where


def _usage(answer: dict[str, Any]) -> dict[str, Any] | None:
    usage = answer.get("usage")
    return {k: usage.get(k) for k in USAGE_COUNTS} if isinstance(usage, dict) else usage


def _indices(answer: dict[str, Any]) -> list[Any]:
    return [c.get("index") for c in answer.get("choices") or []]


def _same_streams(front: list[Any], engine: list[Any], greedy: bool, where: str) -> None:
    assert _kinds(front) == _kinds(engine), where
    mine = [e for e in front if _kind(e) == "chunk"]
    theirs = [e for e in engine if _kind(e) == "chunk"]
    assert _keys(mine) == _keys(theirs), where
    assert _keys(c for chunk in mine for c in chunk["choices"]) == \
        _keys(c for chunk in theirs for c in chunk["choices"]), where
    assert _per_choice(mine, greedy) == _per_choice(theirs, greedy), where
    assert [_usage(e) for e in front if _kind(e) == "usage"] == \
        [_usage(e) for e in engine if _kind(e) == "usage"], where


def _kind(event: Any) -> str:
    if event == "[DONE]":
        return "done"
    if isinstance(event, dict) and "error" in event and not event.get("choices"):
        return "error"
    if isinstance(event, dict) and event.get("choices") == [] and "usage" in event:
        return "usage"
    return "chunk"


def _kinds(stream: list[Any]) -> list[str]:
    """The kinds of a stream's events in order, runs of one kind as one."""
    out: list[str] = []
    for event in stream:
        kind = _kind(event)
        if not out or out[-1] != kind:
            out.append(kind)
    return out


def _keys(objects: Any) -> set[str]:
    return {key for obj in objects for key in obj}


def _per_choice(chunks: list[dict[str, Any]], greedy: bool) -> dict[Any, dict[str, Any]]:
    """Per choice index: its role, its last finish_reason and, for greedy cases, its text and
    token ids put together."""
    out: dict[Any, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen = out.setdefault(choice.get("index"), {"role": None, "finish_reason": None,
                                                        "text": "", "token_ids": []})
            delta = choice.get("delta") or {}
            seen["role"] = seen["role"] or delta.get("role")
            seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
            if greedy:
                seen["text"] += choice.get("text") or delta.get("content") or ""
                seen["token_ids"] += choice.get("token_ids") or []
    return out
