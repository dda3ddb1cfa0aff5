"""The model identity two kvbridge engines exchange on the side channel (issue #35).

A prefill and a decode that load different weights under one model name pass vLLM's
compatibility hash, so the decode would answer from KV the other model computed. Without an
operator nobody compares their KVEndpoints; instead a kvbridge decode asks a kvbridge prefill
for its identity on the prefill's side channel and declines its reads when the two differ.

The request is ``["kvbridge_identity", 1]`` (msgpack): a two-element array whose first item is
a string, which vLLM's ``(GET_META_MSG, pp_rank, tp_rank)`` never is. It goes only to a peer
whose ``kv_transfer_params`` carry :data:`MARKER_KEY` (a kvbridge prefill), because vLLM's
listener dies on a request it cannot unpack. The reply is a msgpack map. Pure: msgspec only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ._model import ModelIdentity

__all__ = [
    "EXCHANGE_VERSION",
    "MARKER_KEY",
    "REQUEST_TAG",
    "Verdict",
    "compare_identities",
    "decode_identity",
    "describe",
    "encode_identity",
    "encode_identity_request",
    "is_identity_request",
]

#: The version of this exchange, stated by a kvbridge prefill under :data:`MARKER_KEY`.
EXCHANGE_VERSION = 1
#: The ``kv_transfer_params`` key by which a kvbridge prefill says it answers the request.
MARKER_KEY = "kvbridge_identity"
#: The first item of the request.
REQUEST_TAG = "kvbridge_identity"

_FIELDS = ("name", "revision", "fingerprint", "vllm_version", "kvbridge_version")
#: Bound of one reply field: a served name is at most 253 characters in a KVEndpoint.
_MAX_FIELD = 1024


def encode_identity_request(version: int = EXCHANGE_VERSION) -> bytes:
    return msgspec.msgpack.encode([REQUEST_TAG, version])


def is_identity_request(message: Any) -> bool:
    """Whether a decoded side-channel request asks for the identity (any version: the
    reply says which one it speaks)."""
    return (isinstance(message, (list, tuple)) and len(message) == 2
            and message[0] == REQUEST_TAG and isinstance(message[1], int))


def encode_identity(identity: ModelIdentity) -> bytes:
    """The reply: ``{"v": 1, "name": ..., "revision": ..., "fingerprint": ..., ...}``."""
    body: dict[str, Any] = {"v": EXCHANGE_VERSION}
    body.update({f: getattr(identity, f) for f in _FIELDS})
    return msgspec.msgpack.encode(body)


def decode_identity(buf: bytes) -> ModelIdentity:
    """The identity in a reply; unknown keys are ignored (a later version may add some).

    Raises:
        ValueError: ``buf`` is not such a map (an error reply, garbage).
    """
    try:
        body = msgspec.msgpack.decode(buf)
    except msgspec.DecodeError as exc:
        raise ValueError(f"identity reply is not msgpack: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("v"), int):
        raise ValueError(f"identity reply is not a versioned map: {str(body)[:200]}")
    values = {f: body.get(f, "") for f in _FIELDS}
    bad = [f for f, v in values.items() if not isinstance(v, str) or len(v) > _MAX_FIELD]
    if bad:
        raise ValueError(f"identity reply: fields {bad} are not strings of at most "
                         f"{_MAX_FIELD} characters")
    return ModelIdentity(**values)


@dataclass(frozen=True)
class Verdict:
    """Whether this decode may read a peer's KV: ``match``, ``mismatch`` (decline every
    read) or ``unchecked`` (nothing to compare: allowed, said once in the log)."""

    status: str
    reason: str

    @property
    def declines(self) -> bool:
        return self.status == "mismatch"


def compare_identities(local: ModelIdentity, remote: ModelIdentity) -> Verdict:
    """Compare what each side serves. Fingerprints decide when both have one (different
    modes, ``sampled-v1`` against ``full-v1``, cannot be told equal and count as different,
    as the operator counts them); otherwise two stated revisions that differ are a
    mismatch, and anything less is unchecked. Served names are not compared: one model may
    be served under two names, and two models under one."""
    if local.fingerprint and remote.fingerprint:
        if local.fingerprint == remote.fingerprint:
            return Verdict("match", "equal fingerprints")
        if local.fingerprint.split(":")[0] != remote.fingerprint.split(":")[0]:
            return Verdict("mismatch", "fingerprints of different modes (set the same "
                           "kvbridge_model_digest on both engines)")
        return Verdict("mismatch", "different fingerprints")
    if local.revision and remote.revision and local.revision != remote.revision:
        return Verdict("mismatch", "different revisions (no fingerprint to compare)")
    side = "this engine" if not local.fingerprint else "the peer"
    return Verdict("unchecked", f"{side} has no model fingerprint (kvbridge_model_digest "
                   "off, or unreadable model files)")


def describe(identity: ModelIdentity) -> str:
    """``name 'x' revision 'r' fingerprint 'f'`` for a log line (``-`` when unknown)."""
    return (f"model {identity.name or '-'!r} revision {identity.revision or '-'!r} "
            f"fingerprint {identity.fingerprint or '-'!r}")
