"""Parsed KVEndpoints in kopf's in-memory index: a status-only change must reach it.

kopf's index keeps the stored value when the new one compares equal, and the planner reads
the previous peers (sticky pairing) and the resourceVersion (orphan writes) from the index.
When ``status`` took no part in equality, the index held each endpoint's status as first seen,
and epoch flaps re-paired engines (tests/e2e/test_operator_load.py). No cluster.
"""

from __future__ import annotations

from kopf._core.engines.indexing import OperatorIndexer

from kvbridge_operator import testing as T
from kvbridge_operator.spec import parse_endpoint

PEERS = [{"name": "p0-0", "engineId": "p0", "role": "prefill", "host": "10.0.0.2",
          "port": 5600, "tpRank": 0, "tpSize": 1, "epoch": 1}]  # fmt: skip


def body(resource_version: str, peers: list | None = None) -> dict:
    b = T.endpoint_manifest("d0-0", role="decode", engine_id="d0", namespace="serving")
    b["metadata"]["resourceVersion"] = resource_version
    if peers is not None:
        b["status"] = {"state": "Paired", "peers": peers}
    return b


def test_a_status_only_change_makes_parses_unequal() -> None:
    assert parse_endpoint(body("1")) == parse_endpoint(body("1"))
    assert parse_endpoint(body("1")) != parse_endpoint(body("2", PEERS))
    assert parse_endpoint(body("1", PEERS)) != parse_endpoint(body("2", PEERS))  # version only
    assert hash(parse_endpoint(body("1"))) == hash(parse_endpoint(body("2", PEERS)))


def test_kopf_index_sees_the_status_written_after_creation() -> None:
    indexer = OperatorIndexer()
    key = ("serving", "d0-0")
    for b in (body("1"), body("2", PEERS)):  # created, then the operator's status write
        e = parse_endpoint(b)
        indexer.replace(key, {("serving", e.transfer): e})
    (stored,) = indexer.index[("serving", "kvt")]
    assert stored.previous_peer_engines == ("p0",)
    assert stored.resource_version == "2"
