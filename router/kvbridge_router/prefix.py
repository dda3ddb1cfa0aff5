"""Which blocks of a prompt each engine already holds in its prefix cache: pure.

A prompt is a chain of block keys, each key the hash of its parent's key and the block's
content, so a key names a whole prefix, as vLLM's block hashes do. Two ways to know what an
engine holds, one index for both:

- **precise** (``observe_stored`` / ``observe_removed`` / ``observe_cleared``): vLLM's KV
  events (``--kv-events-config``) say which blocks an engine stored and evicted, with their
  token ids. The key is computed here from those token ids (and the block's extra keys: LoRA,
  cache salt, multimodal), not taken from vLLM's hash, whose seed is random per process
  unless every engine shares ``PYTHONHASHSEED``; a prompt's keys come from its token ids
  (the engines' ``/tokenize``) with the same function. A stored block whose parent the index
  never saw (an event missed) is skipped: the index may under-count, never claim a block an
  engine lacks because of a lost event. Events come after the work, though: a prompt sent to
  an engine is *expected* there (``expect``) until a deadline, so that the requests behind it
  that share its prefix follow it instead of computing it on another engine meanwhile. The
  engine's own word ends an expectation early: once an event stores or removes a block, the
  events alone say whether it is held (an expectation renewed by every request would
  otherwise hide the eviction of a prefix that is still being asked for).
- **approximate** (``record``): without events, the router remembers the prompts it sent to
  each engine, keyed by fixed-size chunks of the prompt's text, and forgets the oldest past
  the engine's block capacity (LRU). It costs nothing at the engines but guesses: an engine
  that evicted early, or a prompt that tokenizes to other block boundaries, is over-counted.

``held(engine, keys)`` is the length of the longest leading run of ``keys`` the engine holds:
the blocks a request there need not compute (prefill) or pull (decode).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence

BlockKey = int
#: the chain's start: the parent key of a prompt's first block
ROOT: BlockKey = 0


def token_block_keys(token_ids: Sequence[int], block_size: int,
                     extra_keys: Sequence[Hashable | None] | None = None,
                     parent: BlockKey = ROOT) -> list[BlockKey]:  # fmt: skip
    """The keys of the full blocks of ``token_ids`` (a partial last block has none: vLLM
    caches only full blocks). Python's hash of a tuple of ints is the same in every process."""
    keys: list[BlockKey] = []
    key = parent
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = extra_keys[index] if extra_keys else None
        block = tuple(token_ids[start:start + block_size])
        key = hash((key, block) if extra is None else (key, block, extra))
        keys.append(key)
    return keys


def text_block_keys(text: str, chars_per_block: int) -> list[BlockKey]:
    """Keys of the full ``chars_per_block`` chunks of ``text``: the approximate mode's blocks
    (about a KV block's worth of text at ~4 characters a token)."""
    keys: list[BlockKey] = []
    key = ROOT
    for start in range(0, len(text) - chars_per_block + 1, chars_per_block):
        key = hash((key, text[start:start + chars_per_block]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Block keys held per engine id, fed by KV events (precise) or by routing (approximate)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: precise: engine -> vLLM's block hash -> our key; and how many vLLM blocks hold a key
        self._by_hash: dict[str, dict[object, BlockKey]] = {}
        self._refs: dict[str, Counter[BlockKey]] = {}
        #: approximate: engine -> keys in least-recently-sent order
        self._recent: dict[str, OrderedDict[BlockKey, None]] = {}
        #: precise, before the events: engine -> key -> the clock time it is expected until
        self._expected: dict[str, dict[BlockKey, float]] = {}
        #: block size per engine, as its events state it (tokens)
        self.block_sizes: dict[str, int] = {}

    # precise: vLLM's KV events
    def observe_stored(self, engine: str, block_hashes: Sequence[object],
                       parent_hash: object | None, token_ids: Sequence[int], block_size: int,
                       extra_keys: Sequence[Hashable | None] | None = None) -> int:  # fmt: skip
        """A BlockStored event; returns how many of its blocks were indexed (0 when its
        parent is unknown here)."""
        hashes = self._by_hash.setdefault(engine, {})
        refs = self._refs.setdefault(engine, Counter())
        self.block_sizes[engine] = block_size
        if parent_hash is None:
            parent = ROOT
        elif parent_hash in hashes:
            parent = hashes[parent_hash]
        else:
            return 0
        tokens = list(token_ids)[:len(block_hashes) * block_size]
        keys = token_block_keys(tokens, block_size, _hashable(extra_keys), parent)
        self._settle(engine, keys)
        for vllm_hash, key in zip(block_hashes, keys, strict=False):
            old = hashes.get(vllm_hash)
            if old == key:
                continue
            if old is not None:
                self._release(engine, old)
            hashes[vllm_hash] = key
            refs[key] += 1
        return len(keys)

    def observe_removed(self, engine: str, block_hashes: Sequence[object]) -> None:
        hashes = self._by_hash.get(engine, {})
        gone = [key for key in (hashes.pop(h, None) for h in block_hashes) if key is not None]
        for key in gone:
            self._release(engine, key)
        self._settle(engine, gone)

    def _settle(self, engine: str, keys: Sequence[BlockKey]) -> None:
        """The engine's events spoke of ``keys``: they are no longer merely expected."""
        expected = self._expected.get(engine)
        if expected:
            for key in keys:
                expected.pop(key, None)

    def observe_cleared(self, engine: str) -> None:
        """AllBlocksCleared, a reconnect that may have missed events, or an engine gone."""
        self._by_hash.pop(engine, None)
        self._refs.pop(engine, None)
        self._recent.pop(engine, None)
        self._expected.pop(engine, None)

    def _release(self, engine: str, key: BlockKey) -> None:
        refs = self._refs[engine]
        refs[key] -= 1
        if refs[key] <= 0:
            del refs[key]

    # approximate: what the router sent where
    def record(self, engine: str, keys: Sequence[BlockKey], capacity: int) -> None:
        """``keys`` were sent to ``engine``; keep at most ``capacity`` keys for it. A prompt's
        tail is forgotten before its head, as vLLM frees a request's blocks tail first: the
        head is what later prompts share."""
        recent = self._recent.setdefault(engine, OrderedDict())
        for key in reversed(keys):
            recent[key] = None
            recent.move_to_end(key)
        while len(recent) > max(capacity, 0):
            recent.popitem(last=False)

    def expect(self, engine: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """A request with ``keys`` was just sent to ``engine``: count them as held for
        ``seconds``, by when its own events have said so (or it failed)."""
        now = self.clock()
        expected = self._expected.setdefault(engine, {})
        if len(expected) > 4 * len(keys) + 1024:   # drop the lapsed now and then
            for key in [k for k, until in expected.items() if until <= now]:
                del expected[key]
        until = now + seconds
        for key in keys:
            expected[key] = until

    # queries
    def held(self, engine: str, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of ``keys`` ``engine`` holds (or is expected to)."""
        refs = self._refs.get(engine) or {}
        recent = self._recent.get(engine) or {}
        expected = self._expected.get(engine) or {}
        now = self.clock() if expected else 0.0
        count = 0
        for key in keys:
            if key not in refs and key not in recent and expected.get(key, 0.0) <= now:
                break
            count += 1
        return count

    def blocks(self, engine: str) -> int:
        """Blocks indexed for ``engine`` (both modes)."""
        return len(self._refs.get(engine, ())) + len(self._recent.get(engine, ()))

    def engines(self) -> list[str]:
        return sorted(set(self._refs) | set(self._recent))


def _hashable(extra_keys: Sequence[object] | None) -> list[Hashable | None] | None:
    """Extra keys as vLLM's events carry them (lists after msgpack) made hashable."""
    if not extra_keys:
        return None
    return [None if e is None else _freeze(e) for e in extra_keys]


def _freeze(value: object) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value  # type: ignore[return-value]
