"""Keep kopf's watch streams alive across a kube-apiserver restart.

kopf 1.45.2 stops the whole operator when a watch (or its listing) is answered 404. A
kube-apiserver that has just restarted answers exactly that for custom resources for a moment:
it serves requests before its CRD informer has synced, and until then
``/apis/kvbridge.io/...`` is "404 page not found". The operator then shut down, hung for a
minute in kopf's peering cleanup, and left KVTransfer finalizers unhandled
(``tests/faults/test_control_plane_faults.py::test_apiserver_restart_mid_reconcile``).

:func:`install` wraps kopf's per-stream routine so that a 404 ends only that stream: kopf lists
again after ``RETRY_S`` plus its reconnect backoff, as it does after 410 Gone. A resource whose
CRD was really deleted is still stopped by kopf's CRD observer, which cancels its stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from kopf._cogs.clients import errors, watching

log = logging.getLogger("kvbridge.operator")

#: Seconds to wait after a 404 before kopf lists the resource again.
RETRY_S = 1.0

_kopf_continuous_watch = watching.continuous_watch


async def continuous_watch(**kwargs: Any) -> AsyncIterator[Any]:
    """kopf's ``continuous_watch``, ended quietly (after ``RETRY_S``) by a 404."""
    try:
        async for item in _kopf_continuous_watch(**kwargs):
            yield item
    except errors.APINotFoundError as exc:
        log.warning(
            "watching %s: the API server answered 404 (%s), as a restarting one does until it "
            "serves custom resources again; listing again in %.0f s",
            kwargs.get("resource"),
            exc,
            RETRY_S,
        )
        await asyncio.sleep(RETRY_S)


def install() -> None:
    """Route kopf's watch streams through :func:`continuous_watch` (idempotent)."""
    watching.continuous_watch = continuous_watch
