"""The cache-aware chooser's inputs, kept current: what each engine's prefix cache holds, what
each engine reports of its load, and each request's prompt as blocks (balance.py decides).

- **Precise tracking** (engines that state ``spec.kvEventsPort``, which kvbridge's connector
  reads from vLLM's ``--kv-events-config``, or ``kv_events_port`` for all): one ZMQ
  subscriber per such engine (``tcp://<engine host>:<port>``) feeds the prefix index
  (kv_events.py); a prompt's blocks come from its token ids, which the engines' ``/tokenize``
  returns (one extra HTTP round trip to a prefill per request; prompts sent as token ids
  need none). A prompt whose opening (its first block's worth of text) no earlier prompt
  through this front had cannot share a cached prefix with one, so it skips that round
  trip: it is chosen on load and room, and tokenized after the choice, off its path, so
  that the prompts behind it that share it find it expected where it went (a front
  restarted, or a prefix cached by other fronts' traffic, costs the first such prompt its
  hit). Engines without events are never credited with a hit. A subscriber that
  misses a batch (a gap in the sequence numbers) or loses its engine forgets that engine's
  blocks and starts over: under-counting costs a cache hit, over-counting would send
  requests to an engine that lacks the blocks.
- **Approximate tracking** (no engine publishes events): a prompt's blocks are chunks of its
  text (``chars_per_token`` characters a token), and the router remembers which it sent
  where, up to each engine's block count. Nothing extra per request, no engine setting; a
  guess.
- **Load**: every ``load_interval_s`` each engine's ``/metrics`` (engine_load.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from . import kv_events, prompts
from . import metrics as m
from .balance import Balancer, Decision, Prompt
from .engine_load import parse_load
from .prefix import text_block_keys, token_block_keys
from .table import Engine, RoutingTable

log = logging.getLogger("kvbridge.router.affinity")


@dataclass(frozen=True)
class TrackingSettings:
    #: the port of the engines' KV-event publishers where their KVEndpoints state none;
    #: 0: only theirs (none at all: approximate tracking)
    kv_events_port: int = 0
    #: how often each engine's /metrics is read (seconds)
    load_interval_s: float = 1.0
    #: characters per token where the prompt's text stands for its tokens (approximate)
    chars_per_token: float = 4.0
    #: the block size in tokens where an engine's KVEndpoint states none
    default_block_size: int = 16
    #: precise: how long a prompt just sent to an engine counts as held there before its
    #: KV events arrive (they come once the engine has computed or pulled it)
    expect_s: float = 15.0
    tokenize_timeout_s: float = 5.0
    #: precise: how many prompt openings are remembered, to tell a prompt that may share a
    #: cached prefix (tokenized before the choice) from one that cannot (after it)
    openings: int = 65536

    def events_port(self, engine: Engine) -> int:
        return engine.kv_events_port or self.kv_events_port

    def precise(self, table: RoutingTable) -> bool:
        """Whether prompts are matched by token ids against KV events (else by text)."""
        return any(self.events_port(e) for e in table.engines.values())


class CacheTracker:
    """Feeds ``balancer.index`` and ``balancer.loads``; turns request bodies into prompts."""

    def __init__(self, balancer: Balancer, settings: TrackingSettings,
                 table: Callable[[], RoutingTable], engine_port: int) -> None:  # fmt: skip
        self.balancer = balancer
        self.settings = settings
        self.table = table
        self.engine_port = engine_port
        self._subscribers: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._turn = 0
        #: hashes of the openings of the prompts seen, least recent first
        self._openings: OrderedDict[int, None] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        #: tokenizations of deferred prompts under way
        self._deferred: set[asyncio.Task[None]] = set()

    def url(self, engine: Engine, path: str) -> str:
        return f"http://{engine.host}:{engine.port or self.engine_port}{path}"

    # prompts
    async def prompt(self, session: aiohttp.ClientSession, body: dict[str, Any],
                     table: RoutingTable) -> Prompt | None:  # fmt: skip
        """``body``'s prompt as blocks of the engines' block size; None when it has no prompt
        the chooser can read (it is then chosen on load alone)."""
        block_size = self._block_size(table)
        chars = max(1, round(block_size * self.settings.chars_per_token))
        if not self.settings.precise(table):
            text = prompts.prompt_text(body)
            keys = text_block_keys(text, chars)
            return Prompt(tuple(keys), math.ceil(len(text) / chars)) if text else None
        self._session = session
        tokens = prompts.token_ids(body)
        if tokens is None:
            request = prompts.tokenize_request(body)
            text = prompts.prompt_text(body)
            if request is not None and text and self._first_opening(text[:chars]):
                return Prompt((), math.ceil(len(text) / chars), deferred=request)
            tokens = await self._tokenize(session, request, table)
        if tokens is None:
            return None
        return Prompt(tuple(token_block_keys(tokens, block_size)),
                      math.ceil(len(tokens) / block_size))  # fmt: skip

    def _first_opening(self, opening: str) -> bool:
        """Whether no prompt seen before began with ``opening``; remembers it."""
        key = hash(opening)
        seen = key in self._openings
        self._openings[key] = None
        self._openings.move_to_end(key)
        while len(self._openings) > self.settings.openings:
            self._openings.popitem(last=False)
        return not seen

    def _block_size(self, table: RoutingTable) -> int:
        """The block size the engines hash by: as their KV events state it, else as their
        KVEndpoints do."""
        sizes = [self.balancer.index.block_sizes.get(e.engine_id) or e.block_size
                 for e in table.engines.values()]  # fmt: skip
        sizes = [s for s in sizes if s]
        return min(sizes) if sizes else self.settings.default_block_size

    async def _tokenize(self, session: aiohttp.ClientSession, request: dict[str, Any] | None,
                        table: RoutingTable) -> list[int] | None:  # fmt: skip
        """The token ids an engine's ``/tokenize`` gives ``request`` (prefills in turn)."""
        prefills = sorted({p.engine_id: p for d in table.decodes()
                           for p in table.prefills_of(d.engine_id)}.items())  # fmt: skip
        if request is None or not prefills:
            return None
        self._turn += 1
        engine = prefills[self._turn % len(prefills)][1]
        try:
            async with session.post(self.url(engine, "/tokenize"), json=request,
                                    timeout=aiohttp.ClientTimeout(
                                        total=self.settings.tokenize_timeout_s)) as resp:
                if resp.status != 200:
                    m.TOKENIZE_FAILURES.inc()
                    return None
                tokens = (await resp.json()).get("tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("tokenize at %s failed: %s", engine.engine_id, exc)
            m.TOKENIZE_FAILURES.inc()
            return None
        return tokens if isinstance(tokens, list) else None

    def chosen(self, decision: Decision, prompt: Prompt | None) -> None:
        """Record the decision: metrics, a debug line, and that both engines will hold the
        prompt (precise: expected until their events say so; approximate: remembered)."""
        m.observe_decision(decision)
        log.debug("%s", decision.describe())
        if prompt is None:
            return
        table = self.table()
        precise = self.settings.precise(table)
        if prompt.deferred is not None:
            if precise and self._session is not None:
                task = asyncio.create_task(self._expect_later(
                    self._session, dict(prompt.deferred), decision, table))
                self._deferred.add(task)
                task.add_done_callback(self._deferred.discard)
            return
        for engine in (decision.pair.prefill, decision.pair.decode):
            if precise:
                self.balancer.index.expect(engine.engine_id, prompt.keys,
                                           self.settings.expect_s)  # fmt: skip
            else:
                self.balancer.index.record(engine.engine_id, prompt.keys,
                                           engine.num_blocks or 1024)  # fmt: skip

    async def _expect_later(self, session: aiohttp.ClientSession, request: dict[str, Any],
                            decision: Decision, table: RoutingTable) -> None:  # fmt: skip
        """A deferred prompt's keys, expected at the engines it went to once known."""
        tokens = await self._tokenize(session, request, table)
        if tokens is None:
            return
        keys = token_block_keys(tokens, self._block_size(table))
        for engine in (decision.pair.prefill, decision.pair.decode):
            self.balancer.index.expect(engine.engine_id, keys, self.settings.expect_s)

    # background: events and loads
    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """Follow the table's engines until ``stop``: subscribers and load polls."""
        ctx = zmq.asyncio.Context()
        try:
            while not stop.is_set():
                table = self.table()
                self._follow(ctx, table)
                await self._poll_loads(session, table)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.load_interval_s)
        finally:
            tasks = [t for _e, t in self._subscribers.values()] + list(self._deferred)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if ctx is not None:
                ctx.destroy(linger=0)

    def _follow(self, ctx: zmq.asyncio.Context, table: RoutingTable) -> None:
        wanted = {e.engine_id: f"tcp://{_bracket(e.host)}:{self.settings.events_port(e)}"
                  for e in table.engines.values() if self.settings.events_port(e)}  # fmt: skip
        for engine_id, (endpoint, task) in list(self._subscribers.items()):
            if wanted.get(engine_id) != endpoint or task.done():
                task.cancel()
                del self._subscribers[engine_id]
                self.balancer.index.observe_cleared(engine_id)
        for engine_id, endpoint in wanted.items():
            if engine_id not in self._subscribers:
                task = asyncio.create_task(self._subscribe(ctx, engine_id, endpoint))
                self._subscribers[engine_id] = (endpoint, task)
        m.KV_EVENT_ENGINES.set(len(self._subscribers))
        if wanted:   # precise: forget engines that left (approximate keeps what it sent)
            for engine_id in self.balancer.index.engines():
                if engine_id not in wanted:
                    self.balancer.index.observe_cleared(engine_id)

    async def _subscribe(self, ctx: zmq.asyncio.Context, engine_id: str, endpoint: str) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        log.info("following the KV events of %s at %s", engine_id, endpoint)
        expected: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    if len(frames) != 3:
                        raise kv_events.EventError(f"expected 3 frames, got {len(frames)}")
                    seq = kv_events.sequence_number(frames[1])
                    events = kv_events.decode_batch(frames[2])
                except kv_events.EventError as exc:
                    m.KV_EVENT_ERRORS.labels("malformed").inc()
                    log.warning("KV events of %s: %s; its blocks forgotten", engine_id, exc)
                    self.balancer.index.observe_cleared(engine_id)
                    expected = None
                    continue
                if expected is not None and seq != expected:
                    m.KV_EVENT_ERRORS.labels("gap").inc()
                    log.warning("KV events of %s: batch %d after %d; its blocks forgotten",
                                engine_id, seq, expected - 1)  # fmt: skip
                    self.balancer.index.observe_cleared(engine_id)
                expected = seq + 1
                applied = kv_events.apply(self.balancer.index, engine_id, events)
                m.KV_EVENT_BLOCKS.labels("stored").inc(applied.stored)
                m.KV_EVENT_BLOCKS.labels("removed").inc(applied.removed)
                m.KV_EVENT_BLOCKS.labels("orphaned").inc(applied.orphaned)
        finally:
            sock.close(linger=0)

    async def _poll_loads(self, session: aiohttp.ClientSession, table: RoutingTable) -> None:
        engines = list(table.engines.values())
        results = await asyncio.gather(*(self._load_of(session, e) for e in engines),
                                       return_exceptions=True)  # fmt: skip
        loads = self.balancer.loads
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, BaseException) or result is None:
                loads.pop(engine.engine_id, None)
            else:
                loads[engine.engine_id] = result
        for gone in set(loads) - {e.engine_id for e in engines}:
            del loads[gone]

    async def _load_of(self, session: aiohttp.ClientSession, engine: Engine) -> Any:
        async with session.get(self.url(engine, "/metrics"),
                               timeout=aiohttp.ClientTimeout(total=2)) as resp:  # fmt: skip
            if resp.status != 200:
                return None
            text = await resp.text()
        load = parse_load(text)
        if load is None:
            return None
        return replace(load, ours=self.balancer.outstanding[engine.engine_id])


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
