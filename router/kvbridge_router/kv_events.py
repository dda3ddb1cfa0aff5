"""vLLM's KV events, as its ZMQ publisher sends them, applied to the prefix index: pure.

The publisher (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT"}'``) sends three frames per batch: the topic, an 8-byte big-endian
sequence number, and a msgpack ``KVEventBatch``: ``[ts, events, data_parallel_rank]``, each
event a map tagged by ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).
Only what the index needs is read, so fields vLLM adds later change nothing; a malformed
batch raises :class:`EventError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from .errors import RouterError
from .prefix import PrefixIndex

_decoder = msgspec.msgpack.Decoder()


class EventError(RouterError, ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True)
class Applied:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    #: stored blocks not indexed: their parent block was never seen (an event missed)
    orphaned: int = 0


def sequence_number(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventError(f"sequence frame: expected 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[dict[str, object]]:
    """The events of one batch, checked for the fields the index reads."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventError(f"KV event batch: not msgpack ({exc})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventError("KV event batch: expected [ts, events, ...]")
    events = batch[1]
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise EventError("KV event: expected a map with a 'type'")
        if event["type"] == "BlockStored":
            _check_stored(event)
        elif event["type"] == "BlockRemoved" and not isinstance(event.get("block_hashes"), list):
            raise EventError("BlockRemoved.block_hashes: expected a list")
    return events


def _check_stored(event: dict[str, object]) -> None:
    hashes, tokens = event.get("block_hashes"), event.get("token_ids")
    size = event.get("block_size")
    if not isinstance(hashes, list) or not isinstance(tokens, list):
        raise EventError("BlockStored.block_hashes and token_ids: expected lists")
    if not isinstance(size, int) or size < 1:
        raise EventError(f"BlockStored.block_size: expected an integer >= 1, got {size!r}")
    if len(tokens) < len(hashes) * size:
        raise EventError(f"BlockStored.token_ids: expected {len(hashes) * size} tokens for "
                         f"{len(hashes)} blocks of {size}, got {len(tokens)}")  # fmt: skip


def apply(index: PrefixIndex, engine: str, events: Sequence[dict[str, object]]) -> Applied:
    """Fold one batch's events (from ``decode_batch``) into ``index`` for ``engine``."""
    stored = removed = cleared = orphaned = 0
    for event in events:
        kind = event["type"]
        if kind == "BlockStored":
            hashes = event["block_hashes"]
            done = index.observe_stored(engine, hashes, event.get("parent_block_hash"),
                                        event["token_ids"], event["block_size"],
                                        event.get("extra_keys"))  # type: ignore[arg-type]
            stored += done
            orphaned += len(hashes) - done  # type: ignore[arg-type]
        elif kind == "BlockRemoved":
            index.observe_removed(engine, event["block_hashes"])  # type: ignore[arg-type]
            removed += len(event["block_hashes"])  # type: ignore[arg-type]
        elif kind == "AllBlocksCleared":
            index.observe_cleared(engine)
            cleared += 1
    return Applied(stored, removed, cleared, orphaned)
