"""Requests that vLLM serves as several: batched prompts (``prompt`` as a list of strings or
of token-id lists) and ``n`` > 1, fanned out as P/D requests of one prompt and one choice
each, and their answers merged the way vLLM 0.30.0 merges its own (``serving.py`` of
completions and chat).

Why ``n`` is split rather than passed on: vLLM runs ``n`` > 1 as n engine requests that
share the request's ``kv_transfer_params``. A prefill asked for n would keep n sets of
blocks and describe one of them; a decode given n would have n requests read one prefill
answer, and the first to finish tells the prefill to free blocks the others still read (a
prefill answer goes to one decode request at most, flow.py). So every choice gets its own
prefill and decode. What vLLM refuses stays the engine's to answer: an ``n`` that is no
count above 1, and ``n`` > 1 with greedy sampling (``temperature`` below vLLM's 1e-5, which
vLLM always refuses: "n must be 1 when using greedy sampling"), go to the prefill whole
(a batch still splits by prompt) and come back as its 400. A ``temperature`` left to the
model's generation config counts as sampling. A list of one prompt is sent as that prompt.

Merged as vLLM does: choice ``index`` = prompt × n + copy; ``usage.prompt_tokens`` counts
each prompt once, ``completion_tokens`` every choice; ``metrics`` is null when several
requests made the answer. A stream interleaves the sub-streams' chunks as they come,
re-indexed and under the first chunk's ``id`` and ``created``; their usage chunks
(``stream_options.include_usage``) are held back and summed into one, before one
``data: [DONE]``. The client's answer starts once every request has its decode's first
bytes: as vLLM checks every prompt of a batch before it answers, a refused prompt is a plain
4xx, the first refused one's. At most ``max_fanout`` requests serve one (a setting); the
request is counted once, under its first request's pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .flow import COMPLETIONS, RequestError
from .sse import DONE, DONE_EVENT, Event, event

#: vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling
SAMPLING_EPS = 1e-5

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class Plan:
    #: the P/D requests, prompt by prompt and copy by copy; one means no fan-out
    bodies: list[dict[str, Any]]
    #: choices per prompt (the client's n, when split)
    copies: int = 1


def plan(path: str, body: dict[str, Any], max_fanout: int) -> Plan:
    """The P/D requests that serve ``body``; RequestError when they would be more than
    ``max_fanout``, or when the router cannot split the request."""
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > 1:
        raise RequestError("prompt_embeds: send one embedding per request (the P/D router "
                           "splits batched prompts, not batched embeddings)")
    prompts = batched_prompts(body.get("prompt")) if path == COMPLETIONS else None
    copies = split_n(body)
    if prompts is None and copies == 1:
        return Plan([body])
    count = (len(prompts) if prompts is not None else 1) * copies
    if count > max_fanout:
        raise RequestError(f"prompt × n: at most {max_fanout} completions per request through "
                           f"the P/D router, got {count}")
    bodies = []
    for prompt in prompts if prompts is not None else [None]:
        one = dict(body)
        if prompts is not None:
            one["prompt"] = prompt
        if copies > 1:
            one["n"] = 1
        bodies.extend(dict(one) for _ in range(copies))
    return Plan(bodies, copies)


def batched_prompts(prompt: Any) -> list[Any] | None:
    """The prompts of a batch (a list of strings, or of token-id lists); None for one
    prompt or for a shape the engine is left to judge."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def split_n(body: dict[str, Any]) -> int:
    """How many single-choice requests serve the client's ``n`` (1: sent as it is)."""
    n = integer(body.get("n"))
    if n is None or n <= 1:
        return 1
    if body.get("temperature") is not None:
        temperature = number(body["temperature"])
        if temperature is None or temperature < SAMPLING_EPS:
            return 1
    return n


def number(value: Any) -> float | None:
    """``value`` as pydantic's lax mode reads a number (vLLM's request models), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def integer(value: Any) -> int | None:
    """``value`` as pydantic's lax mode reads an integer, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    as_float = number(value)
    return int(as_float) if as_float is not None and as_float.is_integer() else None


# -- whole answers -------------------------------------------------------------------------
def merge_answers(p: Plan, answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One answer out of the sub-requests' (in ``p.bodies`` order)."""
    out = dict(answers[0])
    out["choices"] = [_reindexed(choice, sub) for sub, answer in enumerate(answers)
                      for choice in answer.get("choices") or []]  # fmt: skip
    usages = [a.get("usage") for a in answers]
    if isinstance(usages[0], dict):
        out["usage"] = merge_usage(p, usages)
    if out.get("metrics") is not None:
        out["metrics"] = None
    return out


def merge_usage(p: Plan, usages: Sequence[Any]) -> dict[str, Any]:
    """Usage of the whole request: each prompt's tokens once (its first copy's), every
    choice's completion tokens; the details of the last prompt (vLLM reports its cached
    tokens), other fields of the first answer."""
    usages = [u if isinstance(u, dict) else {} for u in usages]
    out = dict(usages[0])
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages[::p.copies])
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    out.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    last = usages[len(usages) - p.copies]
    if "prompt_tokens_details" in last:
        out["prompt_tokens_details"] = last["prompt_tokens_details"]
    if isinstance(out.get("completion_tokens_details"), dict):
        out["completion_tokens_details"] = _summed([u.get("completion_tokens_details")
                                                    for u in usages])  # fmt: skip
    return out


def _summed(details: list[Any]) -> dict[str, Any]:
    out = dict(details[0])
    for key, value in out.items():
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = sum(d.get(key) or 0 for d in details if isinstance(d, dict))
    return out


def _reindexed(choice: Any, sub: int) -> Any:
    if not isinstance(choice, dict):
        return choice
    index = choice.get("index")
    return {**choice, "index": sub + (index if isinstance(index, int) else 0)}


# -- streams -------------------------------------------------------------------------------
class StreamMerge:
    """One SSE stream out of the sub-requests' streams, fed event by event."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        #: a sub-stream sent an error event: the merged stream ends after it
        self.failed = False
        self._head: dict[str, Any] = {}
        self._usage: list[Any] = [None] * len(p.bodies)
        self._usage_chunk: dict[str, Any] | None = None

    def feed(self, sub: int, ev: Event) -> list[bytes]:
        """What to send for sub-stream ``sub``'s event ``ev``."""
        if ev.data is None:
            return [ev.raw]
        if ev.data == DONE:
            return []
        try:
            chunk = _decode(ev.data)
        except msgspec.DecodeError:
            return [ev.raw]
        if not isinstance(chunk, dict):
            return [ev.raw]
        choices = chunk.get("choices")
        if "error" in chunk and not choices:
            self.failed = True
            return [ev.raw]
        if choices == [] and isinstance(chunk.get("usage"), dict):
            self._usage[sub] = chunk["usage"]
            self._usage_chunk = self._usage_chunk or chunk
            return []
        if isinstance(choices, list):
            chunk["choices"] = [_reindexed(c, sub) for c in choices]
        return [event(_encode(self._headed(chunk)))]

    def finish(self) -> bytes:
        """The end of a merged stream that did not fail: the summed usage chunk, if the
        sub-streams sent theirs, and ``[DONE]``."""
        if self._usage_chunk is None or self.failed:
            return DONE_EVENT
        chunk = dict(self._usage_chunk, usage=merge_usage(self.plan, self._usage))
        if chunk.get("metrics") is not None:
            chunk["metrics"] = None
        return event(_encode(self._headed(chunk))) + DONE_EVENT

    def _headed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """``chunk`` under the merged stream's id and creation time (the first chunk's)."""
        for key in ("id", "created"):
            if key in chunk:
                chunk[key] = self._head.setdefault(key, chunk[key])
        return chunk
