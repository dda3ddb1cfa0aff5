"""Steady load through kvbridge's router with the official ``openai`` client, streaming and
not, recorded per request: when it started and ended, the revision that served it (the
``x-kvbridge-revision`` header), its text, and its error. Rollout and restart tests on the real
node judge each answer against the single-engine reference of the revision that served it,
count failures by cause and measure the longest time without an answer.

A stream counts as answered only when it ends with a ``finish_reason``: a stream cut short
without an error event is a failure here, as it is for a user.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvbridge_testkit.vllm_pods import MODEL

REVISION_HEADER = "x-kvbridge-revision"


@dataclass(frozen=True)
class Outcome:
    """One request: ``text`` when answered, ``error`` (its class and message) when not."""

    prompt: str
    stream: bool
    started: float
    ended: float
    revision: str = ""
    text: str | None = None
    error: str = ""
    #: when a stream's first token arrived (0.0 when not streamed or none came)
    first_token: float = 0.0

    @property
    def ttft(self) -> float | None:
        """Seconds from the request to a stream's first token; None for the others."""
        return self.first_token - self.started if self.first_token else None


@dataclass
class LoadRecord:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def answered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.text is not None]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.text is None]

    def wrong(self, references: Mapping[str, Mapping[str, str]]) -> list[Outcome]:
        """Answers that differ from ``references[revision][prompt]`` (or whose revision has
        no reference)."""
        return [o for o in self.answered
                if references.get(o.revision, {}).get(o.prompt) != o.text]

    def per_revision(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.answered:
            counts[o.revision] = counts.get(o.revision, 0) + 1
        return counts

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time between ``start`` and ``end`` in which no request was answered."""
        marks = [start, *sorted(o.ended for o in self.answered if start <= o.ended <= end), end]
        return max(b - a for a, b in itertools.pairwise(marks))


def _one(client: object, prompt: str, max_tokens: int, stream: bool) -> Outcome:
    extra = {"ignore_eos": True}
    started = time.monotonic()
    try:
        raw = client.completions.with_raw_response.create(  # type: ignore[attr-defined]
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream,
            extra_body=extra)
        revision = raw.headers.get(REVISION_HEADER, "")
        body = raw.parse()
        if stream:
            pieces, finish, first = [], None, 0.0
            for chunk in body:
                for choice in chunk.choices:
                    if choice.text and not first:
                        first = time.monotonic()
                    pieces.append(choice.text or "")
                    finish = choice.finish_reason or finish
            if finish is None:
                return Outcome(prompt, stream, started, time.monotonic(), revision,
                               error="stream ended without a finish_reason")
            return Outcome(prompt, stream, started, time.monotonic(), revision,
                           "".join(pieces), first_token=first)
        return Outcome(prompt, stream, started, time.monotonic(), revision,
                       body.choices[0].text)
    except Exception as exc:  # openai's errors, and httpx's when a stream breaks off
        status = getattr(exc, "status_code", None)
        return Outcome(prompt, stream, started, time.monotonic(),
                       error=f"{type(exc).__name__}{f' {status}' if status else ''}: {exc}")


@contextlib.contextmanager
def openai_load(base_url: str, prompts: Sequence[str], max_tokens: int, clients: int = 4,
                timeout: float = 120.0, pause_after_failure_s: float = 0.0
                ) -> Iterator[LoadRecord]:  # fmt: skip
    """``clients`` threads, each with its own ``openai.OpenAI`` client (no retries), sending
    greedy completions back to back, every other one streamed, while the block runs. A client
    waits ``pause_after_failure_s`` after a failed request (as a client backing off would;
    without it, a fast 503 turns each second without capacity into hundreds of failures)."""
    import openai

    record, stop, prompts = LoadRecord(), threading.Event(), list(prompts)
    lock = threading.Lock()

    def client(offset: int) -> None:
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                            timeout=timeout)
        n = offset
        while not stop.is_set():
            outcome = _one(api, prompts[n % len(prompts)], max_tokens, stream=n % 2 == 1)
            n += 1
            with lock:
                record.outcomes.append(outcome)
            if outcome.text is None and pause_after_failure_s:
                stop.wait(pause_after_failure_s)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        try:
            yield record
        finally:
            stop.set()
        for f in futures:
            f.result()
