"""Manifest builders for tests, benchmarks and demos (pure dicts, no API calls).

``transfer_manifest`` and ``endpoint_manifest`` produce valid KVTransfer / KVEndpoint objects
with a small MLA-like geometry by default; keyword arguments override any field, and
``regions`` / ``geometry`` overrides let a test build an incompatible peer.
``largest_endpoint`` and ``largest_transfer`` build the largest objects the CRD schemas and
the webhook admit (see :mod:`.limits`).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from kvbridge_agent.resources import (
    API_VERSION,
    ENDPOINT_KIND,
    HANDSHAKE_FIELDS,
    TRANSFER_KIND,
    HandshakeState,
    document,
)

from . import limits

DEFAULT_HASH = hashlib.sha256(b"kvbridge-test-model").hexdigest()


def regions(
    n: int = 4,
    *,
    block_len: int = 4096,
    num_blocks: int = 1000,
    mem_type: str = "VRAM",
    group_id: int = 0,
) -> list[dict[str, Any]]:
    """``n`` uniform regions named like vLLM layers."""
    return [
        {
            "name": f"model.layers.{i}.self_attn.attn",
            "numBlocks": num_blocks,
            "groupId": group_id,
            "memType": mem_type,
            "blockLen": block_len,
            "blockStride": block_len,
        }
        for i in range(n)
    ]


def transfer_manifest(
    name: str = "kvt",
    namespace: str | None = None,
    *,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    mode: str = "pull",
    **spec: Any,
) -> dict[str, Any]:
    """A KVTransfer; extra keyword arguments are merged into ``spec``."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": TRANSFER_KIND,
        "metadata": {"name": name},
        "spec": {
            "protocolVersion": 11,
            "mode": mode,
            "prefill": {"tensorParallelSize": prefill_tp},
            "decode": {"tensorParallelSize": decode_tp},
        },
    }
    if namespace:
        body["metadata"]["namespace"] = namespace
    body["spec"].update(spec)
    return body


def endpoint_manifest(
    name: str,
    *,
    role: str,
    engine_id: str,
    transfer: str = "kvt",
    namespace: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    epoch: int = 1,
    mode: str = "pull",
    host: str = "10.0.0.1",
    port: int = 5600,
    pod: Mapping[str, str] | None = None,
    node_name: str = "",
    geometry: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A KVEndpoint. ``pod`` (``{"name", "uid"}``) adds the ownerReference to that Pod."""
    geo = {
        "blockSize": 16,
        "physicalBlocksPerLogical": 1,
        "numBlocks": 1000,
        "kvCacheLayout": "HND",
        "attentionBackend": "FLASHMLA",
        "isMla": True,
        "regions": regions(),
    }
    geo.update(copy.deepcopy(dict(geometry or {})))
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": ENDPOINT_KIND,
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "transferName": transfer,
            "role": role,
            "engineId": engine_id,
            "podName": (pod or {}).get("name", name),
            "sideChannel": {"host": host, "port": port},
            "tpRank": tp_rank,
            "tpSize": tp_size,
            "dpIndex": 0,
            "protocolVersion": 11,
            "compatibilityHash": DEFAULT_HASH,
            "mode": mode,
            "epoch": epoch,
            "geometry": geo,
        },
    }
    if node_name:
        body["spec"]["nodeName"] = node_name
    if namespace:
        body["metadata"]["namespace"] = namespace
    if pod:
        body["spec"]["podUID"] = pod["uid"]
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": pod["name"], "uid": pod["uid"]}
        ]
    body["spec"].update(spec)
    return body


def engine_manifests(engine_id: str, role: str, tp_size: int = 1, **kw: Any) -> list[dict]:
    """One KVEndpoint per TP rank of an engine, named ``<engine_id>-<rank>``."""
    return [
        endpoint_manifest(
            f"{engine_id}-{r}", role=role, engine_id=engine_id, tp_rank=r, tp_size=tp_size, **kw
        )
        for r in range(tp_size)
    ]


def handshake(peer: str, epoch: int, ok: bool = True, message: str = "",
              transport: str = "") -> dict[str, Any]:  # fmt: skip
    """One ``status.handshakes`` entry as the agent writes it."""
    values: dict[str, Any] = {
        "peer": peer,
        "epoch": epoch,
        "state": str(HandshakeState.SUCCEEDED if ok else HandshakeState.FAILED),
        "time": "2025-01-01T00:00:00Z",
        "message": message,  # the agent leaves an empty message out
    }
    if transport:  # ... and reports the transport of succeeded ones
        values.update(transport=transport, transport_detail=f"{transport}/dev0")
    return document(HANDSHAKE_FIELDS, values)


def largest_endpoint(schema: Mapping[str, Any], name: str, *, transfer: str = "kvt") -> dict:
    """The largest KVEndpoint that ``schema`` (the CRD's openAPIV3Schema) and the webhook
    admit: every field at its bound, made valid where the webhook asks more than the schema
    (the protocol version kvbridge speaks, unique region names, a DNS name as host)."""
    spec = limits.largest(schema["properties"]["spec"], "spec")
    spec.update(transferName=transfer, protocolVersion=11, podUID=limits.UUID)
    spec["sideChannel"]["host"] = limits.longest_dns_name()
    for i, region in enumerate(spec["geometry"]["regions"]):
        region["name"] = f"{i}.".ljust(len(region["name"]), "a")
    return {"apiVersion": API_VERSION, "kind": ENDPOINT_KIND, "metadata": {"name": name},
            "spec": spec}


def largest_transfer(schema: Mapping[str, Any], name: str) -> dict:
    """The largest KVTransfer that ``schema`` and the webhook admit (label keys in
    Kubernetes' syntax, set-based requirements with values)."""
    spec = limits.largest(schema["properties"]["spec"], "spec")
    spec["protocolVersion"] = 11
    spec["pairing"]["topologyKey"] = limits.longest_label_key(0)
    for role in ("prefill", "decode"):
        for i, expr in enumerate(spec[role]["selector"]["matchExpressions"]):
            expr.update(key=limits.longest_label_key(i), operator="NotIn")
    return {"apiVersion": API_VERSION, "kind": TRANSFER_KIND, "metadata": {"name": name},
            "spec": spec}


def largest_status(schema: Mapping[str, Any]) -> dict:
    """The largest ``status`` ``schema`` admits."""
    return limits.largest(schema["properties"]["status"], "status")
