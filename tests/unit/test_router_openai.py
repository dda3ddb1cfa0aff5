"""The router's OpenAI surface against engines that answer as vLLM 0.30.0 does (aiohttp
servers playing the engine: one token per word, a context of ``MAX_LEN`` tokens, vLLM's
error messages and its way of counting a prompt against the context). Expected answers come
from the fake engine asked directly, as tests/e2e/openai_surface.py asks a real one.

Checked: an engine's 4xx is the client's answer, never retried and counted ``rejected``, and
a prompt too long for the context is described for the client's own ``max_tokens``;
batched prompts and ``n`` fan out and merge with vLLM's indices and usage, streams included;
what vLLM refuses about ``n`` stays the engine's to refuse. And the pure parts: the messages
re-derived from vLLM's literal wording, the fan-out plan, SSE parsing and stream merging.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvbridge_router import metrics as m
from kvbridge_router.__main__ import _serve_http
from kvbridge_router.batching import Plan, StreamMerge, merge_answers, plan
from kvbridge_router.client_errors import prefill_rejection
from kvbridge_router.flow import CHAT, COMPLETIONS, RequestError
from kvbridge_router.proxy import Router, RouterSettings
from kvbridge_router.sse import Event, Parser
from kvbridge_router.table import Engine, RoutingTable
from kvbridge_testkit.prometheus import counts_by_label
from local_http import serve_locally

MAX_LEN = 32
MODEL = "m"


# -- an engine that answers as vLLM does -----------------------------------------------------
def vllm_error(message: str, kind: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def words(path: str, body: dict[str, Any]) -> list[str] | list[int]:
    if path == CHAT:
        return [w for msg in body["messages"] for w in str(msg["content"]).split()]
    prompt = body["prompt"]
    return prompt if isinstance(prompt, list) else prompt.split()


def refusal(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM 0.30.0's 4xx for ``body``, in its order: the model, the prompt's length
    (``TokenizeParams``), then the sampling parameters; None when it is served."""
    if body.get("model") != MODEL:
        return vllm_error(f"The model `{body.get('model')}` does not exist.", "NotFoundError",
                          404, "model")  # fmt: skip
    if path == CHAT:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        out = body.get(param) or 0
    else:       # null is the default, 16
        param, out = "max_tokens", 16 if body.get("max_tokens") is None else body["max_tokens"]
    if out > MAX_LEN:
        return vllm_error(f"{param}={out} cannot be greater than max_model_len=max_total_tokens="
                          f"{MAX_LEN}. Please request fewer output tokens. "
                          f"(parameter={param}, value={out})", param=param)  # fmt: skip
    tokens, inputs = words(path, body), MAX_LEN - out
    count = len(tokens) if tokens and isinstance(tokens[0], int) \
        else min(len(tokens), inputs + 1)     # text is tokenized up to inputs + 1 tokens
    if count > inputs:
        least = "at least " if count == inputs + 1 else ""
        return vllm_error(
            f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
            f"{out} output tokens and your prompt contains {least}{count} input tokens, for a "
            f"total of {least}{count + out} tokens. Please reduce the length of the input "
            f"prompt or the number of requested output tokens. "
            f"(parameter=input_tokens, value={count})", param="input_tokens")
    n, temperature = body.get("n", 1), body.get("temperature")
    n = 1 if n is None else n
    if n < 1:
        return vllm_error(f"n must be at least 1, got {n}.")
    if temperature is not None and temperature < 0:
        return vllm_error(f"temperature must be non-negative, got {float(temperature)}. "
                          f"(parameter=temperature, value={float(temperature)})",
                          param="temperature")  # fmt: skip
    if n > 1 and temperature is not None and temperature < 1e-5:
        return vllm_error(f"n must be 1 when using greedy sampling, got {n}.")
    return None


def pieces(path: str, body: dict[str, Any]) -> list[str]:
    """The tokens a decode generates: named after the prompt's first word."""
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return [f" {words(path, body)[0]}{k}" for k in range(out)]


@dataclass
class FakeVLLM:
    """One engine. ``calls`` by kind: prefill (do_remote_decode), decode (do_remote_prefill)
    and direct (no kv_transfer_params: the engine asked as a client would). A direct request
    is served with one prompt and n = 1 only, which is all the tests ask directly."""

    name: str
    calls: Counter[str] = field(default_factory=Counter)
    runner: web.AppRunner | None = None
    port: int = 0
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def start(self) -> FakeVLLM:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post(COMPLETIONS, self.handle)
        app.router.add_post(CHAT, self.handle)
        self.runner, self.port = await serve_locally(app)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def engine(self, role: str) -> Engine:
        return Engine(self.name, role, "127.0.0.1", (self.name,), port=self.port)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        kind = "prefill" if params.get("do_remote_decode") else \
            "decode" if params.get("do_remote_prefill") else "direct"
        self.calls[kind] += 1
        error = refusal(request.path, body)
        if error is not None:
            return web.json_response(error, status=error["error"]["code"])
        chat = request.path == CHAT
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{next(self._ids)}",
                "object": "chat.completion" if chat else "text_completion", "created": 1,
                "model": MODEL}  # fmt: skip
        if kind == "prefill":
            return web.json_response({**head, "choices": [self.choice(chat, " x", True)],
                                      "kv_transfer_params": {
                                          "do_remote_prefill": True,
                                          "remote_engine_id": self.name}})
        parts = pieces(request.path, body)
        usage = {"prompt_tokens": len(words(request.path, body)),
                 "completion_tokens": len(parts),
                 "total_tokens": len(words(request.path, body)) + len(parts)}
        if not body.get("stream"):
            return web.json_response({**head, "choices": [self.choice(chat, "".join(parts),
                                                                      True)],
                                      "usage": usage, "kv_transfer_params": None})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if chat:
            await self.send(out, {**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for k, part in enumerate(parts):
            await asyncio.sleep(0)      # let other streams interleave
            choice = self.choice(chat, part, k == len(parts) - 1, delta=True)
            await self.send(out, {**head, "object": "chat.completion.chunk" if chat else
                                  "text_completion", "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await self.send(out, {**head, "choices": [], "usage": usage})
        await out.write(b"data: [DONE]\n\n")
        return out

    @staticmethod
    def choice(chat: bool, text: str, last: bool, delta: bool = False) -> dict[str, Any]:
        finish = "length" if last else None
        if not chat:
            return {"index": 0, "text": text, "finish_reason": finish}
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, "delta" if delta else "message": message, "finish_reason": finish}

    @staticmethod
    async def send(out: web.StreamResponse, chunk: dict[str, Any]) -> None:
        await out.write(f"data: {json.dumps(chunk)}\n\n".encode())


@dataclass
class Front:
    url: str
    engines: dict[str, FakeVLLM]

    def direct(self, name: str = "p0") -> str:
        return f"http://127.0.0.1:{self.engines[name].port}"

    def calls(self, kind: str) -> int:
        return sum(e.calls[kind] for e in self.engines.values())


@contextlib.asynccontextmanager
async def serving(prefills: int = 2, decodes: int = 2,
                  settings: RouterSettings | None = None) -> AsyncIterator[Front]:  # fmt: skip
    """Fake engines p0.., d0.. (every decode verified with every prefill) behind a router
    run with the production server options."""
    names = [f"p{i}" for i in range(prefills)] + [f"d{i}" for i in range(decodes)]
    engines = {n: await FakeVLLM(n).start() for n in names}
    table = RoutingTable(
        {d: tuple(n for n in names if n.startswith("p")) for d in names if d.startswith("d")},
        {n: e.engine("prefill" if n.startswith("p") else "decode") for n, e in engines.items()},
        reason="")  # fmt: skip
    runner = await _serve_http(Router(lambda: table, settings or RouterSettings()).app(),
                               "127.0.0.1", 0)  # fmt: skip
    try:
        yield Front(f"http://127.0.0.1:{runner.addresses[0][1]}", engines)
    finally:
        await runner.cleanup()
        for e in engines.values():
            await e.stop()


def run(scenario: Callable[[Front], Any], **kwargs: Any) -> None:
    async def main() -> None:
        async with serving(**kwargs) as front:
            await scenario(front)
    asyncio.run(main())


async def post(url: str, body: dict[str, Any], path: str = COMPLETIONS) -> tuple[int, Any]:
    """(status, JSON answer, or the SSE events' data for a stream)."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
        if r.content_type != "text/event-stream":
            return r.status, await r.json(content_type=None)
        text = await r.text()
    return r.status, [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


def outcomes() -> Counter[str]:
    """kvbridge_router_requests_total by outcome, all pairs together."""
    return counts_by_label(m.REQUESTS, "kvbridge_router_requests_total", "outcome")


def retries() -> float:
    return sum(s.value for metric in m.RETRIES.collect() for s in metric.samples
               if s.name == "kvbridge_router_retries_total")  # fmt: skip


LONG = " ".join(f"w{i}" for i in range(50))
BODY = {"model": MODEL, "prompt": "alpha beta gamma", "max_tokens": 3, "temperature": 0}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "alpha beta"}],
             "max_tokens": 3, "temperature": 0}  # fmt: skip


# -- client errors ---------------------------------------------------------------------------
def test_a_prefills_4xx_is_the_clients_answer_once_never_retried() -> None:
    async def scenario(f: Front) -> None:
        before, retried = outcomes(), retries()
        for body in ({**BODY, "model": "nope"}, {**BODY, "temperature": -1}):
            expected = await post(f.direct(), body)
            assert expected[0] in (400, 404)
            assert await post(f.url, body) == expected
        assert f.calls("prefill") == 2 and f.calls("decode") == 0
        assert outcomes() - before == Counter(rejected=2) and retries() == retried
    run(scenario)


def test_a_decodes_4xx_passes_through_once() -> None:
    """max_tokens above the context: the prefill, asked for one token, accepts; the decode,
    asked with the client's max_tokens, refuses, as the engine would have at once."""
    async def scenario(f: Front) -> None:
        before = outcomes()
        body = {**BODY, "max_tokens": MAX_LEN + 8}
        expected = await post(f.direct(), body)
        assert expected[0] == 400
        assert await post(f.url, body) == expected
        assert f.calls("prefill") == 1 and f.calls("decode") == 1
        assert outcomes() - before == Counter(rejected=1)
    run(scenario)


def test_a_prompt_too_long_is_described_for_the_clients_own_max_tokens() -> None:
    async def scenario(f: Front) -> None:
        cases = [(COMPLETIONS, {**BODY, "prompt": LONG}),
                 (COMPLETIONS, {**BODY, "prompt": LONG, "max_tokens": None}),
                 (COMPLETIONS, {**BODY, "prompt": list(range(MAX_LEN + 8))}),  # exact count
                 # The prefill takes it (one output token fits), the decode refuses it.
                 (COMPLETIONS, {**BODY, "prompt": list(range(MAX_LEN - 1))}),
                 (COMPLETIONS, {**BODY, "prompt": LONG, "max_tokens": MAX_LEN + 1}),
                 (CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": LONG}]}),
                 (CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": LONG}],
                         "max_completion_tokens": 5})]  # fmt: skip
        for path, body in cases:
            status, answer = await post(f.url, body, path)
            assert (status, answer) == await post(f.direct(), body, path), body
            assert "requested 1 output tokens" not in answer["error"]["message"]
        assert f.calls("prefill") == len(cases) and f.calls("decode") == 1
    run(scenario)


# -- batched prompts and n -------------------------------------------------------------------
def test_batched_prompts_and_n_are_answered_with_vllms_indices_and_usage() -> None:
    async def scenario(f: Front) -> None:
        body = {**BODY, "prompt": ["a b", "c d e"], "n": 2, "temperature": 0.7}
        status, answer = await post(f.url, body)
        assert status == 200
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in answer["choices"]] == \
            [" a0 a1 a2"] * 2 + [" c0 c1 c2"] * 2
        assert answer["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": 4 * 3,
                                   "total_tokens": 5 + 12}  # fmt: skip
        assert f.calls("prefill") == 4 and f.calls("decode") == 4
        # Batched token prompts, and a list of one prompt (sent as that prompt).
        status, answer = await post(f.url, {**BODY, "prompt": [[7, 8], [9, 10, 11]]})
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
        assert answer["usage"]["prompt_tokens"] == 5
        one = await post(f.url, {**BODY, "prompt": ["alpha beta gamma"]})
        alone = await post(f.url, BODY)
        assert one[1]["choices"] == alone[1]["choices"] and one[1]["usage"] == alone[1]["usage"]
        # Chat with n.
        status, answer = await post(f.url, {**CHAT_BODY, "n": 3, "temperature": 1}, CHAT)
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2]
        assert answer["usage"]["prompt_tokens"] == 2
        assert answer["usage"]["completion_tokens"] == 9
    run(scenario)


def test_what_vllm_refuses_about_n_is_the_engines_answer() -> None:
    async def scenario(f: Front) -> None:
        for body in ({**BODY, "n": 2}, {**BODY, "n": 0},
                     {**BODY, "n": 2, "prompt": ["a", "b"]}):  # fmt: skip
            expected = await post(f.direct(), {**body, "prompt": "a"})
            assert expected[0] == 400
            assert await post(f.url, body) == expected
        # n left whole: the prefill refuses it (each prompt of the batch asks its own).
        assert f.calls("prefill") >= 3 and f.calls("decode") == 0
    run(scenario)


def test_a_batch_with_a_prompt_too_long_is_that_prompts_400() -> None:
    async def scenario(f: Front) -> None:
        before = outcomes()
        body = {**BODY, "prompt": ["a", LONG, "b", LONG]}
        expected = await post(f.direct(), {**BODY, "prompt": LONG})
        assert await post(f.url, body) == expected
        assert outcomes() - before == Counter(rejected=1)
    run(scenario)


def test_more_completions_than_the_fanout_limit_are_refused() -> None:
    async def scenario(f: Front) -> None:
        status, answer = await post(f.url, {**BODY, "prompt": ["a", "b"], "n": 3,
                                            "temperature": 1})  # fmt: skip
        assert status == 400 and "at most 4 completions" in answer["error"]["message"]
        assert f.calls("prefill") == 0
    run(scenario, settings=RouterSettings(max_fanout=4))


def test_a_fanned_out_stream_interleaves_reindexed_chunks_and_ends_once() -> None:
    async def scenario(f: Front) -> None:
        body = {**BODY, "prompt": ["a b", "c d e"], "n": 2, "temperature": 0.7,
                "stream": True, "stream_options": {"include_usage": True}}
        status, events = await post(f.url, body)
        assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        usage = [c for c in chunks if not c["choices"]]
        assert usage == [chunks[-1]]
        assert usage[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                     "total_tokens": 17}  # fmt: skip
        text: dict[int, str] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
        assert text == {0: " a0 a1 a2", 1: " a0 a1 a2", 2: " c0 c1 c2", 3: " c0 c1 c2"}
        # Chat: every choice gets its role chunk first.
        status, events = await post(f.url, {**CHAT_BODY, "n": 3, "temperature": 1,
                                            "stream": True}, CHAT)  # fmt: skip
        assert status == 200 and events[-1] == "[DONE]"
        first: dict[int, dict[str, Any]] = {}
        for chunk in map(json.loads, events[:-1]):
            (choice,) = chunk["choices"]
            first.setdefault(choice["index"], choice["delta"])
        assert first == {i: {"role": "assistant", "content": ""} for i in range(3)}
    run(scenario)


# -- pure parts ------------------------------------------------------------------------------
def vllm_context_message(total: int, out: int, count: int, least: bool) -> str:
    """vLLM 0.30.0's ``TokenizeParams._token_len_check`` message, literally."""
    q = "at least " if least else ""
    return (f"This model's maximum context length is {total} tokens. However, you requested "
            f"{out} output tokens and your prompt contains {q}{count} input tokens, for a total "
            f"of {q}{count + out} tokens. Please reduce the length of the input prompt or the "
            f"number of requested output tokens. (parameter=input_tokens, value={count})")


def rejection(message: str, param: str = "input_tokens") -> bytes:
    return json.dumps(vllm_error(message, param=param)).encode()


def message_of(raw: bytes) -> tuple[str, str]:
    error = json.loads(raw)["error"]
    return error["message"], error["param"]


def test_the_prefills_context_messages_are_rederived_for_the_clients_request() -> None:
    prefill = rejection(vllm_context_message(1024, 1, 1024, least=True))
    for tokens, count in ((4, 1021), (16, 1009), (1, 1024)):
        body = {"prompt": "long", "max_tokens": tokens}
        assert message_of(prefill_rejection(COMPLETIONS, body, prefill)) == \
            (vllm_context_message(1024, tokens, count, least=True), "input_tokens")
    # Completions default to 16, null included; chat counts max_completion_tokens first, and
    # none as 0.
    for body in ({"prompt": "long"}, {"prompt": "long", "max_tokens": None}):
        assert "requested 16 output tokens" in message_of(
            prefill_rejection(COMPLETIONS, body, prefill))[0]
    chat = {"messages": [], "max_tokens": 9, "max_completion_tokens": 7}
    assert message_of(prefill_rejection(CHAT, chat, prefill))[0] == \
        vllm_context_message(1024, 7, 1018, least=True)
    assert message_of(prefill_rejection(CHAT, {"messages": []}, prefill))[0] == \
        vllm_context_message(1024, 0, 1025, least=True)
    # Token ids are counted exactly (never truncated).
    exact = rejection(vllm_context_message(1024, 1, 1100, least=False))
    assert message_of(prefill_rejection(COMPLETIONS, {"prompt": [1] * 1100, "max_tokens": 4},
                                        exact))[0] == \
        vllm_context_message(1024, 4, 1100, least=False)  # fmt: skip
    # max_tokens above the context: vLLM's first check.
    assert message_of(prefill_rejection(COMPLETIONS, {"max_tokens": 2000}, prefill)) == (
        "max_tokens=2000 cannot be greater than max_model_len=max_total_tokens=1024. Please "
        "request fewer output tokens. (parameter=max_tokens, value=2000)", "max_tokens")
    # The character check, before tokenizing.
    chars = rejection(
        "This model's maximum context length is 1024 tokens. However, you requested 1 output "
        "tokens and your prompt contains 10000000 characters (more than 5115 characters, "
        "which is the upper bound for 1023 input tokens). Please reduce the length of the "
        "input prompt or the number of requested output tokens. "
        "(parameter=input_text, value=10000000)", "input_text")
    assert message_of(prefill_rejection(COMPLETIONS, {"max_tokens": 4}, chars)) == (
        "This model's maximum context length is 1024 tokens. However, you requested 4 output "
        "tokens and your prompt contains 10000000 characters (more than 5100 characters, "
        "which is the upper bound for 1020 input tokens). Please reduce the length of the "
        "input prompt or the number of requested output tokens. "
        "(parameter=input_text, value=10000000)", "input_text")


def test_a_validation_error_about_the_whole_body_counts_the_clients_keys() -> None:
    """vLLM 0.30.0's answer to a chat request without messages, as the prefill gives it:
    the body it saw has the router's keys (stream, kv_transfer_params) too."""
    client = {"model": MODEL, "max_tokens": 8}

    def missing(keys: int) -> bytes:
        return rejection(f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.messages', "
                         f"'msg': 'Field required', 'input': '<dict of {keys} items>'}}",
                         "body.messages")
    assert json.loads(prefill_rejection(CHAT, client, missing(4))) == json.loads(missing(2))
    # Another size (a nested object's) is left alone.
    assert prefill_rejection(CHAT, client, missing(7)) == missing(7)


def test_other_prefill_errors_pass_unchanged() -> None:
    for raw in (rejection("temperature must be non-negative, got -1.0."), b"not json",
                json.dumps({"detail": "x"}).encode()):
        assert prefill_rejection(COMPLETIONS, {"max_tokens": 4}, raw) == raw
    # A max_tokens that is no integer: the engine would refuse it, not re-derived.
    prefill = rejection(vllm_context_message(1024, 1, 1024, least=True))
    assert prefill_rejection(COMPLETIONS, {"max_tokens": "4"}, prefill) == prefill


def test_the_fanout_plan() -> None:
    base = {"model": MODEL, "prompt": "p", "max_tokens": 2}
    assert plan(COMPLETIONS, base, 8) == Plan([base])
    assert plan(COMPLETIONS, {**base, "prompt": ["a"]}, 8).bodies == [{**base, "prompt": "a"}]
    two = plan(COMPLETIONS, {**base, "prompt": ["a", "b"], "n": 2, "temperature": 1}, 8)
    assert two.copies == 2
    assert [(b["prompt"], b["n"]) for b in two.bodies] == [("a", 1), ("a", 1), ("b", 1), ("b", 1)]
    assert [b["prompt"] for b in plan(COMPLETIONS, {**base, "prompt": [[1], [2]]}, 8).bodies] \
        == [[1], [2]]
    # n as pydantic reads it; greedy or invalid n is sent unsplit, for the engine to refuse.
    assert len(plan(CHAT, {"messages": [], "n": "3"}, 8).bodies) == 3
    assert len(plan(CHAT, {"messages": [], "n": 3.0, "temperature": "0.5"}, 8).bodies) == 3
    for n, temperature in ((2, 0), (2, "0"), (2, -1), (0, 1), ("two", 1), (2.5, 1), (True, 1)):
        body = {**base, "n": n, "temperature": temperature}
        assert plan(COMPLETIONS, body, 8) == Plan([body]), (n, temperature)
    # Shapes the router does not split are the engine's to judge.
    for prompt in ([], [1, "a"], [[1], "a"], "p"):
        assert plan(COMPLETIONS, {**base, "prompt": prompt}, 8).bodies == [{**base,
                                                                             "prompt": prompt}]
    for refused in ({**base, "prompt": ["a"] * 9}, {**base, "n": 9, "temperature": 1},
                    {**base, "prompt_embeds": ["x", "y"]}):  # fmt: skip
        try:
            plan(COMPLETIONS, refused, 8)
        except RequestError:
            continue
        raise AssertionError(f"not refused: {refused}")


def test_whole_answers_merge_with_vllms_indices_usage_and_metrics() -> None:
    fan = Plan([{}] * 4, copies=2)
    answers = [{"id": f"cmpl-{i}", "choices": [{"index": 0, "text": str(i)}], "metrics": {},
                "usage": {"prompt_tokens": 10 + i // 2, "completion_tokens": 3,
                          "total_tokens": 13 + i // 2,
                          "prompt_tokens_details": {"cached_tokens": i}}}
               for i in range(4)]  # fmt: skip
    merged = merge_answers(fan, answers)
    assert merged["id"] == "cmpl-0" and merged["metrics"] is None
    assert merged["choices"] == [{"index": i, "text": str(i)} for i in range(4)]
    assert merged["usage"] == {"prompt_tokens": 10 + 11, "completion_tokens": 12,
                               "total_tokens": 33, "prompt_tokens_details": {"cached_tokens": 2}}


def test_sse_events_split_anywhere() -> None:
    stream = b'data: {"a": 1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    for size in (1, 3, len(stream)):
        parser = Parser()
        events = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i:i + size])]
        assert [e.data for e in events] == ['{"a": 1}', None, "[DONE]"]
        assert b"".join(e.raw for e in events) == stream and parser.rest() is None


def test_a_stream_merge_reindexes_heads_sums_usage_and_ends_once() -> None:
    merge = StreamMerge(Plan([{}] * 2))

    def feed(sub: int, chunk: dict[str, Any] | str) -> list[bytes]:
        data = chunk if isinstance(chunk, str) else json.dumps(chunk)
        return merge.feed(sub, Event(f"data: {data}\n\n".encode(), data))

    def sent(out: list[bytes]) -> list[dict[str, Any]]:
        return [json.loads(b.removeprefix(b"data: ")) for b in out]

    assert sent(feed(1, {"id": "b", "created": 2, "choices": [{"index": 0, "text": "y"}]})) == \
        [{"id": "b", "created": 2, "choices": [{"index": 1, "text": "y"}]}]
    assert sent(feed(0, {"id": "a", "created": 1, "choices": [{"index": 0, "text": "x"}]})) == \
        [{"id": "b", "created": 2, "choices": [{"index": 0, "text": "x"}]}]
    for sub in (0, 1):
        assert feed(sub, {"id": "a", "choices": [], "usage": {
            "prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}) == []
        assert feed(sub, "[DONE]") == []
    end = merge.finish()
    assert end.endswith(b"data: [DONE]\n\n") and end.count(b"[DONE]") == 1
    (usage,) = sent([end.split(b"\n\n")[0]])
    assert usage["id"] == "b" and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 2,
                                                     "total_tokens": 6}
    failing = StreamMerge(Plan([{}] * 2))
    error = json.dumps(vllm_error("boom", "InternalServerError", 500))
    assert failing.feed(0, Event(f"data: {error}\n\n".encode(), error))
    assert failing.failed and failing.finish() == b"data: [DONE]\n\n"
