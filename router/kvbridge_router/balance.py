"""Choosing a pair, the one place that decides "which pair" for every front (the router, the
endpoint picker, the decode sidecar). Pure; the callers own the counts' updates, the table,
the prefix index and the engines' reported loads.

Two policies (``ChooserSettings.policy``):

- ``least-load``: the decode engine with the fewest outstanding requests, then the one of its
  verified prefills with the fewest.
- ``cache-aware``: every verified pair gets an estimated cost in milliseconds, and the
  cheapest wins::

      cost = (prompt blocks - blocks the prefill holds
              + blocks still to compute for its requests in flight
              + blocks it must evict to store them * eviction_weight) * prefill_ms_per_block
           + (blocks the decode lacks
              + blocks it must evict to store them * eviction_weight)
             * (pull_ms_per_block + block bytes / the pair's transport throughput)
           + queue at the prefill * queue_ms + queue at the decode * decode_queue_ms

  where an engine's queue is the requests this front has in flight there now, plus those of
  other fronts: what the engine last reported running and waiting (its ``/metrics``) beyond
  what this front had there at that moment (a report is up to a poll interval old; this
  front's own count is exact). A prefill's wait is its work, not its request count: a request
  whose prefix it holds computes a few blocks, a cold one the whole prompt, so the blocks
  each request in flight there was chosen to compute count too. A prefill whose pool is full
  (its ``num_blocks`` less the blocks its index holds and those its requests in flight are
  storing) must evict a block for every new one, and an evicted block is one a later prompt
  computes again: each costs ``eviction_weight`` blocks of compute. So a prompt is computed
  anew on a second engine only when the wait at the one holding it outweighs both, and a
  new prefix goes where there is room for it. A full decode's evictions cost the pulls
  they will cause, alike. A balance guard comes first:
  an engine whose queue with this request added would exceed both ``balance_factor`` times
  its role's mean and that mean plus ``balance_slack`` requests is left out while another
  engine of that role is within it, so a hot prefix cannot pile every request on one engine
  (the slack keeps a mean of one or two requests from forbidding a second request on the
  engine that holds the prefix). A request without a prompt (nothing to
  match) is scored on load and transfer only. A prefill's queue weighs more than a decode's:
  prompts are computed one batch after another, while a decode adds a new request to the
  batch it is already running.

Ties go round-robin (by a rotating offset), so idle engines share the first requests instead
of the alphabetically first one taking them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .prefix import BlockKey, PrefixIndex
from .table import Engine, RoutingTable

POLICIES = ("least-load", "cache-aware")
#: GB/s a pair's KV moves at, by UCX transport family, where nothing was measured: the order
#: of magnitude each reaches on current hardware (shared memory and RDMA an order above TCP).
DEFAULT_GBPS: Mapping[str, float] = {
    "tcp": 1.0, "cma": 10.0, "posix": 10.0, "sysv": 10.0, "xpmem": 10.0, "knem": 10.0,
    "rc": 20.0, "dc": 20.0, "ud": 20.0, "ib": 20.0, "cuda_ipc": 100.0, "gdr_copy": 20.0,
}  # fmt: skip
UNKNOWN_GBPS = 1.0


#: a response header naming the model revision of the pair that served (table.Engine.revision)
REVISION_HEADER = "x-kvbridge-revision"


@dataclass(frozen=True)
class Pair:
    decode: Engine
    prefill: Engine
    #: the prompt blocks the prefill was chosen to compute (cache-aware; 0 otherwise): its
    #: work while the request is in flight there
    prefill_blocks: int = field(default=0, compare=False)

    @property
    def label(self) -> str:
        return f"{self.prefill.engine_id}->{self.decode.engine_id}"

    @property
    def revision(self) -> str:
        """The model revision that served (table.py keeps pairs within one)."""
        return self.decode.revision


@dataclass(frozen=True)
class Prompt:
    """What the chooser knows of one request's prompt."""

    #: the keys of its full blocks (prefix.py), in order
    keys: tuple[BlockKey, ...]
    #: the blocks it fills, a partial last one included: what a decode holding none pulls
    blocks: int
    #: a prompt whose opening no earlier one shared (precise tracking): chosen without its
    #: keys, as it can be held nowhere, and tokenized after the choice with this ``/tokenize``
    #: request, so that the prompts behind it find it expected where it went
    deferred: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class EngineLoad:
    """What an engine reports of itself (vLLM's ``/metrics``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    #: this front's own requests at the engine when it reported (the rest are others')
    ours: int = 0


@dataclass(frozen=True)
class ChooserSettings:
    policy: str = "least-load"
    #: what computing one block of prompt costs a prefill (ms)
    prefill_ms_per_block: float = 1.0
    #: what one request already at a prefill adds to a new one's wait (ms)
    queue_ms: float = 10.0
    #: what one block a decode lacks costs it beyond the wire time: descriptors, the
    #: transfer's set-up and completion, the engine's step around it (ms)
    pull_ms_per_block: float = 0.1
    #: what one request already at a decode adds to a new one's first token (ms)
    decode_queue_ms: float = 2.0
    #: what evicting one block from a full engine costs, in blocks of its work (a
    #: prefill's compute, a decode's pull): what it is likely to cause a later prompt
    eviction_weight: float = 1.0
    #: no engine's queue above this multiple of its role's mean (with the new request) ...
    balance_factor: float = 1.5
    #: ... when it is also more than this many requests above that mean
    balance_slack: float = 3.0
    #: throughput by transport family (GB/s) for the transfer estimate
    transport_gbps: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_GBPS))

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")  # fmt: skip
        for name in ("prefill_ms_per_block", "queue_ms", "pull_ms_per_block", "decode_queue_ms",
                     "eviction_weight", "balance_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a number >= 0, got {getattr(self, name)}")
        if self.balance_factor < 1:
            raise ValueError(f"balance_factor: expected a number >= 1, "
                             f"got {self.balance_factor}")  # fmt: skip

    def gbps(self, transport: str) -> float:
        """The slowest of a pair's transports (``cma+tcp``: tcp), by family (``rc_mlx5``:
        rc); unknown or unstated ones count as TCP."""
        rates = []
        for name in (transport or "").split("+"):
            family = name.split("_mlx")[0].split("/")[0].strip()
            rate = self.transport_gbps.get(name) or self.transport_gbps.get(family)
            rates.append(rate if rate else UNKNOWN_GBPS)
        return min(rates) if rates else UNKNOWN_GBPS


@dataclass(frozen=True)
class Decision:
    """The chosen pair and the parts of its score (all zero under least-load)."""

    pair: Pair
    policy: str
    prompt_blocks: int = 0
    prefill_hit_blocks: int = 0
    decode_hit_blocks: int = 0
    pull_bytes: int = 0
    transfer_ms: float = 0.0
    queue: int = 0
    cost_ms: float = 0.0
    #: blocks the prefill is estimated to evict to store the ones it computes
    evict_blocks: int = 0
    #: blocks the decode is estimated to evict to store the ones it pulls
    decode_evict_blocks: int = 0

    def describe(self) -> str:
        return (f"pair {self.pair.label} ({self.policy}): cost {self.cost_ms:.1f} ms, prompt "
                f"{self.prompt_blocks} blocks, held by prefill {self.prefill_hit_blocks} and "
                f"decode {self.decode_hit_blocks}, evicting {self.evict_blocks} and "
                f"{self.decode_evict_blocks}, pull "
                f"{self.pull_bytes} B ({self.transfer_ms:.2f} ms), queue {self.queue}")  # fmt: skip


@dataclass
class Balancer:
    """Outstanding requests per engine id, and the choice of the next pair."""

    settings: ChooserSettings = field(default_factory=ChooserSettings)
    #: what each engine's prefix cache holds (cache-aware)
    index: PrefixIndex = field(default_factory=PrefixIndex)
    #: what each engine reports of its load, by engine id (cache-aware)
    loads: dict[str, EngineLoad] = field(default_factory=dict)
    outstanding: Counter[str] = field(default_factory=Counter)
    #: prompt blocks still to compute per prefill engine id, for its requests in flight
    work: Counter[str] = field(default_factory=Counter)
    _turn: int = 0

    def pick(self, table: RoutingTable, avoid: Collection[tuple[str, str]] = (),
             decodes: Collection[str] | None = None, prompt: Prompt | None = None
             ) -> Pair | None:  # fmt: skip
        decision = self.decide(table, avoid, decodes, prompt)
        return decision.pair if decision is not None else None

    def decide(self, table: RoutingTable, avoid: Collection[tuple[str, str]] = (),
               decodes: Collection[str] | None = None, prompt: Prompt | None = None
               ) -> Decision | None:  # fmt: skip
        """The pair for one request, None when no pair is left. ``avoid``: (decode id,
        prefill id) pairs that already failed this request; ``decodes`` (engine ids) narrows
        the decodes to choose from: the gateway's subset hint, or the sidecar's own engine;
        ``prompt``: the request's blocks, for the cache-aware policy."""
        self._turn += 1
        candidates = [d for d in table.decodes()
                      if decodes is None or d.engine_id in decodes]  # fmt: skip
        if self.settings.policy == "cache-aware":
            return self._cheapest(table, candidates, avoid, prompt)
        return self._least_loaded(table, candidates, avoid)

    def _least_loaded(self, table: RoutingTable, candidates: list[Engine],
                      avoid: Collection[tuple[str, str]]) -> Decision | None:  # fmt: skip
        order = sorted(range(len(candidates)), key=lambda i: (
            self.outstanding[candidates[i].engine_id], (i - self._turn) % len(candidates)))
        for i in order:
            decode = candidates[i]
            prefills = [p for p in table.prefills_of(decode.engine_id)
                        if (decode.engine_id, p.engine_id) not in avoid]  # fmt: skip
            if prefills:
                best = min(range(len(prefills)), key=lambda j: (
                    self.outstanding[prefills[j].engine_id], (j - self._turn) % len(prefills)))
                return Decision(Pair(decode, prefills[best]), "least-load")
        return None

    def queue(self, engine: Engine) -> int:
        """Requests ahead of a new one at ``engine``: this front's now, others' as last
        reported."""
        own = self.outstanding[engine.engine_id]
        reported = self.loads.get(engine.engine_id)
        if reported is None:
            return own
        return own + max(reported.running + reported.waiting - reported.ours, 0)

    def _cheapest(self, table: RoutingTable, candidates: list[Engine],
                  avoid: Collection[tuple[str, str]], prompt: Prompt | None
                  ) -> Decision | None:  # fmt: skip
        pairs = [Pair(d, p) for d in candidates for p in table.prefills_of(d.engine_id)
                 if (d.engine_id, p.engine_id) not in avoid]  # fmt: skip
        if not pairs:
            return None
        queues = {e.engine_id: self.queue(e)
                  for pair in pairs for e in (pair.decode, pair.prefill)}  # fmt: skip
        eligible = [p for p in pairs if self._within_guard(p, pairs, queues)] or pairs
        scored = [self._score(table, pair, prompt, queues) for pair in eligible]
        offset = self._turn % len(scored)
        best = min(range(len(scored)),
                   key=lambda i: (scored[i].cost_ms, (i - offset) % len(scored)))  # fmt: skip
        return scored[best]

    def _within_guard(self, pair: Pair, pairs: list[Pair], queues: Mapping[str, int]) -> bool:
        """Both engines of ``pair`` stay within the guard once this request joins them: their
        queue at most ``balance_factor`` times their role's mean, or at most
        ``balance_slack`` requests above it."""
        s = self.settings
        for engine, role in ((pair.decode, "decode"), (pair.prefill, "prefill")):
            peers = {(p.decode if role == "decode" else p.prefill).engine_id for p in pairs}
            load = queues[engine.engine_id] + 1
            mean = (sum(queues[e] for e in peers) + 1) / len(peers)
            if load > s.balance_factor * mean and load > mean + s.balance_slack:
                return False
        return True

    def _wait_ms(self, prefill: Engine, queues: Mapping[str, int]) -> float:
        """What a new request waits at ``prefill`` for the work already there."""
        s = self.settings
        return (self.work[prefill.engine_id] * s.prefill_ms_per_block
                + queues[prefill.engine_id] * s.queue_ms)

    def _score(self, table: RoutingTable, pair: Pair, prompt: Prompt | None,
               queues: Mapping[str, int]) -> Decision:  # fmt: skip
        s = self.settings
        keys = prompt.keys if prompt else ()
        blocks = prompt.blocks if prompt else 0
        prefill_hit = self.index.held(pair.prefill.engine_id, keys)
        decode_hit = self.index.held(pair.decode.engine_id, keys)
        # a deferred prompt's keys are not known yet: held nowhere, all of it to compute
        deferred = prompt is not None and prompt.deferred is not None
        prefill_blocks = blocks if deferred else len(keys) - prefill_hit
        pull_blocks = max(blocks - decode_hit, 0)
        pull_bytes = pull_blocks * pair.decode.block_bytes
        gbps = s.gbps(table.transport(pair.decode.engine_id, pair.prefill.engine_id))
        ms_per_pulled_block = pair.decode.block_bytes / (gbps * 1e6) + s.pull_ms_per_block
        transfer_ms = pull_blocks * ms_per_pulled_block
        queue_p, queue_d = queues[pair.prefill.engine_id], queues[pair.decode.engine_id]
        evict_p = self.evictions(pair.prefill, prefill_blocks)
        evict_d = self.evictions(pair.decode, pull_blocks)
        cost = ((prefill_blocks + evict_p * s.eviction_weight) * s.prefill_ms_per_block
                + self._wait_ms(pair.prefill, queues) + transfer_ms
                + evict_d * s.eviction_weight * ms_per_pulled_block
                + queue_d * s.decode_queue_ms)  # fmt: skip
        chosen = Pair(pair.decode, pair.prefill, prefill_blocks)
        return Decision(chosen, "cache-aware", blocks, prefill_hit, decode_hit, pull_bytes,
                        transfer_ms, queue_p + queue_d, cost, evict_p, evict_d)  # fmt: skip

    def evictions(self, engine: Engine, blocks: int) -> int:
        """Blocks ``engine`` must evict to store ``blocks`` new ones: beyond its free room,
        its pool less what its index holds and what its requests in flight will store.
        0 where its pool size is not known."""
        if blocks <= 0 or engine.num_blocks <= 0:
            return 0
        used = self.index.blocks(engine.engine_id) + self.work[engine.engine_id]
        return max(blocks - max(engine.num_blocks - used, 0), 0)

    def start(self, engine: Engine, blocks: int = 0) -> None:
        """A request is in flight at ``engine``, with ``blocks`` of prompt to compute."""
        self.outstanding[engine.engine_id] += 1
        if blocks:
            self.work[engine.engine_id] += blocks

    def done(self, engine: Engine, blocks: int = 0) -> None:
        for counts, n in ((self.outstanding, 1), (self.work, blocks)):
            if n:
                counts[engine.engine_id] -= n
                if counts[engine.engine_id] <= 0:
                    del counts[engine.engine_id]
