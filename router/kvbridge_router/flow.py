"""vLLM's P/D request flow as pure request rewriting (docs/routing.md, "The P/D request flow"):

1. the prefill gets the request with ``max_tokens`` 1, no streaming, no ``min_tokens``, and
   ``kv_transfer_params`` asking it to keep the prompt's KV for a remote decode;
2. the decode gets the client's request with the ``kv_transfer_params`` the prefill returned,
   and its answer goes to the client.

Also the lease rule: a prefill keeps the blocks of a finished request for its lease
(``kv_lease_duration``, vLLM's default 30 s) and then frees them, and a stock vLLM decode
that reads after that reads whatever the blocks hold by then. An answer older than the lease
minus a safety margin is therefore never forwarded.

And a prefill answer goes to one decode at most: a decode that failed may already have read
the blocks and told the prefill to free them, so a second decode given the same answer could
read blocks that hold another request's KV by then. A retry always prefills again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import RouterError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

#: What the prefill is asked to keep (vLLM's NIXL connector reads these keys).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}  # fmt: skip


class RequestError(RouterError, ValueError):
    """The client's request cannot take the P/D path; the message names the field."""


def check_request(path: str, body: Any) -> dict[str, Any]:
    """The request body as a dict, or RequestError naming what is wrong. Only what the P/D
    flow itself needs is checked here: the rest of the request is the engines' to judge, and
    their 4xx is the client's answer (batched prompts and ``n``: batching.py)."""
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object")
    if "kv_transfer_params" in body:
        raise RequestError("kv_transfer_params: set by the router, not by clients")
    return body


def prefill_request(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill's request: compute the prompt, keep its KV for the decode. Only top-level
    keys change, so a shallow copy leaves the client's body as it was."""
    out = dict(body)
    out["max_tokens"] = 1
    if path == CHAT and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_request(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]
                   ) -> dict[str, Any]:  # fmt: skip
    """The decode's request: the client's, reading the prompt's KV from the prefill."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def transfer_params(answer: Any) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill's answer; ValueError when it has none (the
    prefill is not a P/D producer: no KV connector, or ``kv_role`` consumer)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill") \
            or not params.get("remote_engine_id"):
        raise ValueError("the prefill answered without kv_transfer_params for a remote decode "
                         "(is its KV connector a producer?)")
    return params


def fresh_enough(answered_at: float, now: float, lease_s: float, margin_s: float) -> bool:
    """True while a prefill answer received at ``answered_at`` can still be forwarded: its
    blocks stay held for ``lease_s`` from about then, and the decode must read them with
    ``margin_s`` to spare (queueing, the read itself, clocks)."""
    return now - answered_at <= lease_s - margin_s
