"""After a watch expires kopf lists again but keeps deleted KVEndpoints in its index (ghosts),
and a restarting API server answers 404 for a moment: how the operator copes. No cluster; the
real thing runs in tests/faults."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kopf._cogs.clients import errors, watching

from kvbridge_operator import kopf_watch, reconciler
from kvbridge_operator import testing as T
from kvbridge_operator.spec import Endpoint, parse_endpoint


class StoredEndpoints:
    """The API as the ghost check reads it: ``listed`` at LIST time, ``now`` at GET time."""

    def __init__(self, listed: dict[str, str], now: dict[str, str]) -> None:
        self.listed, self.now = listed, now
        self.calls: list[str] = []

    async def endpoint_uids(self, namespace: str) -> set[str]:
        self.calls.append("list")
        return set(self.listed.values())

    async def endpoint_uid(self, namespace: str, name: str) -> str | None:
        self.calls.append(f"get {name}")
        return self.now.get(name)


def ep(name: str, uid: str) -> Endpoint:
    body = T.endpoint_manifest(name, role="decode", engine_id=name, namespace="ns")
    body["metadata"]["uid"] = uid
    return parse_endpoint(body)


def test_ghosts_are_index_entries_no_longer_stored() -> None:
    index = [ep("kept", "u1"), ep("deleted", "u2"), ep("newer", "u3"), ep("recreated", "u4")]
    api = StoredEndpoints(
        listed={"kept": "u1", "recreated": "u9"},  # "newer" was created after the LIST
        now={"kept": "u1", "newer": "u3", "recreated": "u9"},
    )
    ghosts = asyncio.run(reconciler.find_ghosts("ns", index, api))  # type: ignore[arg-type]
    assert ghosts == {"u2", "u4"}
    assert api.calls == ["list", "get deleted", "get newer", "get recreated"]


def test_no_endpoints_no_api_call() -> None:
    api = StoredEndpoints({}, {})
    assert asyncio.run(reconciler.find_ghosts("ns", [], api)) == set()  # type: ignore[arg-type]
    assert api.calls == []


def test_ghost_check_due_at_start_after_a_listing_and_each_resync() -> None:
    loops = reconciler.PlanningLoops()
    memory = reconciler.WriteMemory()
    assert memory.check_due(loops.listings, resync=300)
    memory.checked = (loops.listings, time.monotonic())
    assert not memory.check_due(loops.listings, resync=300)
    loops.relisted()
    assert memory.check_due(loops.listings, resync=300)
    memory.checked = (loops.listings, time.monotonic() - 301)
    assert memory.check_due(loops.listings, resync=300)


@pytest.fixture
def kopf_stream(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """kopf's own stream replaced by one that yields an event, then meets a 404."""
    seen: list[Any] = []

    async def fake(**kwargs: Any) -> Any:
        seen.append(kwargs)
        yield {"type": "ADDED"}
        raise errors.APINotFoundError("404 page not found", status=404, headers={})

    monkeypatch.setattr(kopf_watch, "_kopf_continuous_watch", fake)
    monkeypatch.setattr(kopf_watch, "RETRY_S", 0.0)
    return seen


def test_a_404_ends_only_the_stream(kopf_stream: list[Any], caplog: Any) -> None:
    async def consume() -> list[Any]:
        return [e async for e in kopf_watch.continuous_watch(resource="kvendpoints")]

    assert asyncio.run(consume()) == [{"type": "ADDED"}]
    assert kopf_stream == [{"resource": "kvendpoints"}]
    assert "answered 404" in caplog.text


def test_the_operator_routes_kopf_watches_through_the_wrapper() -> None:
    import kvbridge_operator.main  # noqa: F401 - installs it

    assert watching.continuous_watch is kopf_watch.continuous_watch
