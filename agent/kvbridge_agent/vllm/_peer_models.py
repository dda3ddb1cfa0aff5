"""A kvbridge decode's record of the model each kvbridge prefill serves (issue #35).

The decode's scheduler forwards which requests came from a kvbridge prefill (their
``kv_transfer_params`` carry ``kvbridge_identity``); before the first read from such an
engine, and again after each new handshake with it (a restart may load other weights), the
handshake thread asks the engine's side channel for its identity
(:mod:`kvbridge_agent.identity._exchange`). Reads from an engine that serves another model are
declined like late reads: the request's blocks are load errors and ``kv_load_failure_policy``
applies. Stock peers are never asked (their listener would die on the request).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .. import metrics
from ..identity import (
    ModelIdentity,
    Verdict,
    compare_identities,
    decode_identity,
    describe,
    encode_identity_request,
)
from ..sidechannel import SideChannelClient, SideChannelError
from ..sidechannel._common import decode_error

__all__ = ["PeerModels", "fetch_identity"]

log = logging.getLogger("kvbridge.vllm")

#: ``fetch(engine_id, host, port, timeout_s)``: the peer's identity; raises on failure.
Fetch = Callable[[str, str, int, float], ModelIdentity]


def fetch_identity(engine_id: str, host: str, port: int, timeout_s: float) -> ModelIdentity:
    """Ask a kvbridge engine's side channel for its identity (one request, one deadline)."""
    with SideChannelClient() as client:
        frames = client.exchange(host, port, encode_identity_request(), timeout_s=timeout_s,
                                 what=f"the model identity of engine {engine_id}")
    if len(frames) != 2:
        raise SideChannelError(f"identity reply of engine {engine_id}: {len(frames)} frames, "
                               "expected 2")
    err = decode_error(frames[0])
    if err is not None:
        raise SideChannelError(f"engine {engine_id} refused the identity request "
                               f"({err.error}): {err.message}")
    return decode_identity(frames[0])


class PeerModels:
    """Verdicts per remote engine id; thread-safe (the step thread reads, the handshake
    thread checks)."""

    def __init__(self, local: ModelIdentity, timeout_s: float, fetch: Fetch = fetch_identity
                 ) -> None:  # fmt: skip
        self.local = local
        self.timeout_s = timeout_s
        self._fetch = fetch
        self._lock = threading.Lock()
        self._marked: set[str] = set()
        #: engine id -> (verdict, its identity, the handshake generation it was checked at)
        self._verdicts: dict[str, tuple[Verdict, ModelIdentity, float | None]] = {}
        self._told_off = False

    def mark(self, engine_id: str) -> None:
        """``engine_id`` runs kvbridge (said by a request's params): check it before reading.
        Without a local fingerprint (``kvbridge_model_digest: off``) nothing is checked."""
        if not self.local.fingerprint:
            if not self._told_off:
                self._told_off = True
                log.warning("kvbridge: this engine has no model fingerprint: reads from "
                            "kvbridge prefills are not checked for the model they serve")
            return
        with self._lock:
            self._marked.add(engine_id)

    def settled(self, engine_id: str, generation: float | None = None) -> bool:
        """Whether a read from ``engine_id`` may be decided now: no check is due, or one was
        made at this ``generation`` of its handshake (``AgentService.loaded_since``: a new
        handshake, after a restart say, may find other weights)."""
        with self._lock:
            if engine_id not in self._marked:
                return True
            got = self._verdicts.get(engine_id)
            return got is not None and got[2] == generation

    def forget(self, engine_id: str) -> None:
        """Ask ``engine_id`` again before its next read."""
        with self._lock:
            self._verdicts.pop(engine_id, None)

    def check(self, engine_id: str, host: str, port: int, generation: float | None = None
              ) -> str:  # fmt: skip
        """Ask a marked engine whose verdict is unknown for its identity (blocking: call it
        off the engine step). Returns why it could not be asked ("" when done or not due);
        no verdict is kept then, so the next request asks again."""
        if self.settled(engine_id, generation):
            return ""
        try:
            remote = self._fetch(engine_id, host, port, self.timeout_s)
        except (SideChannelError, ValueError) as exc:
            return f"model identity not obtained: {exc}"
        verdict = compare_identities(self.local, remote)
        with self._lock:
            self._verdicts[engine_id] = (verdict, remote, generation)
        mine, theirs = describe(self.local), describe(remote)
        if verdict.declines:
            log.error("kvbridge: remote engine %s serves another model (%s): this engine "
                      "serves %s, it serves %s; declining every read from it "
                      "(kv_load_failure_policy applies)", engine_id, verdict.reason, mine,
                      theirs)
        elif verdict.status == "unchecked":
            log.warning("kvbridge: reads from remote engine %s are not checked: %s (this "
                        "engine: %s; it: %s)", engine_id, verdict.reason, mine, theirs)
        else:
            log.info("kvbridge: remote engine %s serves the same model (%s)", engine_id,
                     theirs)
        return ""

    def declines(self, engine_id: str, req_id: str) -> bool:
        """Whether to decline ``req_id``'s read from ``engine_id`` (counted, logged)."""
        with self._lock:
            verdict = self._verdicts.get(engine_id)
        if verdict is None or not verdict[0].declines:
            return False
        metrics.READS_DECLINED.labels("model_mismatch").inc()
        log.warning("declining the read of request %s from engine %s: it serves another "
                    "model (%s); kv_load_failure_policy applies", req_id, engine_id,
                    verdict[0].reason)
        return True

    def verdict(self, engine_id: str) -> Verdict | None:
        with self._lock:
            got = self._verdicts.get(engine_id)
        return got[0] if got else None
