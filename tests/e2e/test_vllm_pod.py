"""Real vLLM 0.30.0 engines as pods on the local control plane, with no user code: each runs
KVBridgeConnector from the one-flag configuration (``kv_role: kv_both``) with the
downward-API variables and a pod-bound ServiceAccount token. The connector publishes the
pod's KVEndpoint from the geometry it registered, the operator pairs the engines, the decode
engine preflights the prefill before any request, the KVTransfer becomes Ready, and then a
request flows through the pair, token for token equal to one engine's output."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_operator.config import ENDPOINTS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, pod_bound_token
from kvbridge_testkit.vllm_harness import (
    EngineProcess,
    RandomPrompts,
    pd_generate,
    running,
    vllm_python,
    warm_pair,
    write_model,
)

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.vllm, pytest.mark.slow]

SA = "kvbridge-agent"


@contextlib.contextmanager
def _engine_pods(cluster: Any, api: Api, ns: str, tmp_path: Path, *, decode_tp: int = 1
                 ) -> Iterator[dict[str, Any]]:  # fmt: skip
    """A prefill pod (TP 1) and a decode pod (TP ``decode_tp``: one pod, its ranks are
    worker processes of one engine), each a real engine with pod identity and token."""
    try:
        vllm_python()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    create_agent_rbac(cluster.api_client(), ns, SA)
    api.create_transfer(ns, decode_tp=decode_tp)
    model = write_model(tmp_path / "model", kind="llama", seed=9)
    engines: dict[str, Any] = {}
    for role, tp in (("prefill", 1), ("decode", decode_tp)):
        pod = SimPod(cluster, ns, f"vllm-{role}-0", role=role, engine_id=f"{ns}-{role}",
                     sa=SA).create_pod()
        token = pod_bound_token(cluster.kubectl, ns, SA, pod.name)
        kubeconfig = cluster.kubeconfig_for_token(token, f"pod-{ns}-{pod.name}")
        engines[role] = EngineProcess(
            model, tmp_path, connector="kvbridge", kv_role="kv_both",
            engine_id=pod.engine_id, name=pod.name, tp_size=tp,
            # a TP-2 engine's spin-waits can stall this 2-core machine for up to ~30 s
            # (docs/limits.md, Known limitations): deadlines that outlast it, nothing relaxed
            extra_config={"kvbridge_transfer_timeout_s": 120, "kv_lease_duration": 150}
            if decode_tp > 1 else None,
            env={"POD_NAME": pod.name, "POD_UID": pod.uid, "POD_NAMESPACE": ns,
                 "NODE_NAME": pod.node, "POD_IP": "127.0.0.1", "KUBECONFIG": str(kubeconfig),
                 "KVBRIDGE_TRANSFER": "kvt", "KVBRIDGE_ROLE": role,
                 "KVBRIDGE_SYNC_INTERVAL_S": "0.5"})
    with running(engines):
        yield engines


@pytest.fixture
def engine_pods(cluster: Any, api: Api, ns: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    with _engine_pods(cluster, api, ns, tmp_path) as engines:
        yield engines


@pytest.fixture
def tp2_engine_pods(cluster: Any, api: Api, ns: str, tmp_path: Path
                    ) -> Iterator[dict[str, Any]]:  # fmt: skip
    with _engine_pods(cluster, api, ns, tmp_path, decode_tp=2) as engines:
        yield engines


def test_vllm_engines_as_pods_pair_preflight_and_serve(api: Api, ns: str,
                                                       engine_pods: dict[str, Any]) -> None:
    prefill, decode = engine_pods["prefill"], engine_pods["decode"]
    endpoints = wait_for(lambda: (lambda e: e if len(e) == 2 else None)(api.endpoints(ns)),
                         timeout=120, what="both KVEndpoints published")
    # Published from what the engine registered: vLLM's layers, backend and layout.
    spec = endpoints["vllm-decode-0"]["spec"]
    assert spec["engineId"] == decode.engine_id and spec["role"] == "decode"
    geometry = spec["geometry"]
    assert [r["name"] for r in geometry["regions"]] == [
        "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert (geometry["attentionBackend"], geometry["kvCacheLayout"]) == ("CPU_ATTN", "LBHNC")
    assert spec["sideChannel"] == {"host": "127.0.0.1", "port": decode.port}
    owner = endpoints["vllm-decode-0"]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Pod", "vllm-decode-0")

    api.wait_condition(ns, "Ready", "True", timeout=180)
    # Preflighted: the decode engine loaded the prefill before any request.
    assert decode.call({"cmd": "connector_state"})["remotes"] == [prefill.engine_id]
    status = api.endpoint(ns, "vllm-decode-0")["status"]
    # Engines in one PID namespace: UCX reads the prefill's KV by cross-memory attach.
    assert [(h["peer"], h["state"], h["transport"]) for h in status["handshakes"]] == [
        ("vllm-prefill-0", "Succeeded", "cma")]
    assert status["peers"][0]["engineId"] == prefill.engine_id

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 170)]
    reference = [o["token_ids"] for o in prefill.generate(prompts, 6)]
    fresh = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 170)]
    reference_fresh = [o["token_ids"] for o in decode.generate(fresh, 6)]
    out = pd_generate(prefill, decode, prompts, 6)
    assert [o.token_ids for o in out] == reference
    loads = decode.call({"cmd": "transfers"})["transfers"]
    assert loads and not [t for t in loads if t["failed"]], loads
    # The decode engine also serves on its own (kv_both) while paired.
    assert [o["token_ids"] for o in decode.generate(fresh, 6)] == reference_fresh
    assert api.list(ENDPOINTS, ns) and api.condition(ns, "Ready")["status"] == "True"


def test_a_tp2_engine_publishes_each_rank_and_every_rank_preflights(
        api: Api, ns: str, tp2_engine_pods: dict[str, Any]) -> None:
    """A TP-2 decode engine in one pod: each rank's worker process publishes its own
    KVEndpoint (``<pod>-tp<rank>``) from what it registered, the operator pairs each rank
    with the prefill rank it reads from (spec §1.9), both ranks preflight it, the KVTransfer
    goes Ready, and a request pulls on both ranks."""
    prefill, decode = tp2_engine_pods["prefill"], tp2_engine_pods["decode"]
    names = ["vllm-decode-0-tp0", "vllm-decode-0-tp1", "vllm-prefill-0"]
    endpoints = wait_for(lambda: (lambda e: e if sorted(e) == names else None)(
        api.endpoints(ns)), timeout=180, what="the three KVEndpoints published")
    prefill_regions = endpoints["vllm-prefill-0"]["spec"]["geometry"]["regions"]
    for rank in (0, 1):
        spec = endpoints[f"vllm-decode-0-tp{rank}"]["spec"]
        assert (spec["engineId"], spec["tpRank"], spec["tpSize"]) == (decode.engine_id, rank, 2)
        assert spec["podName"] == "vllm-decode-0"
        # What that rank registered: one of the model's two KV heads, half a TP-1 block.
        assert [r["blockLen"] * 2 for r in spec["geometry"]["regions"]] == [
            r["blockLen"] for r in prefill_regions]
        owner = endpoints[f"vllm-decode-0-tp{rank}"]["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("Pod", "vllm-decode-0")

    api.wait_condition(ns, "Ready", "True", timeout=240)
    for rank in (0, 1):
        status = api.endpoint(ns, f"vllm-decode-0-tp{rank}")["status"]
        assert [(p["name"], p["engineId"], p["tpRank"]) for p in status["peers"]] == [
            ("vllm-prefill-0", prefill.engine_id, 0)]
        assert [(h["peer"], h["state"], h["transport"]) for h in status["handshakes"]] == [
            ("vllm-prefill-0", "Succeeded", "cma")]
    state = decode.call({"cmd": "connector_state"})
    assert [r["remotes"] for r in state["ranks"]] == [[prefill.engine_id]] * 2

    # the TP-2 pair's first READ can wait on a CPU-starved prefill (docs/limits.md)
    warm_pair(prefill, decode)
    decode.call({"cmd": "transfers"})   # forget the warm-up's records
    prompts = RandomPrompts(11)
    batch = [prompts(n) for n in (40, 170)]
    out = pd_generate(prefill, decode, batch, 6)
    loads = decode.call({"cmd": "transfers"})["transfers"]
    assert {t["rank"] for t in loads} == {0, 1} and not [t for t in loads if t["failed"]], loads
    assert [o.token_ids for o in out] == [o["token_ids"] for o in prefill.generate(batch, 6)]
