"""Real vLLM 0.30.0 engines as pods on the local control plane, with no user code: each runs
KVBridgeConnector from the one-flag configuration (``kv_role: kv_both``) with the
downward-API variables and a pod-bound ServiceAccount token. The connector publishes the
pod's KVEndpoint from the geometry it registered, the operator pairs the engines, the decode
engine preflights the prefill before any request, the KVTransfer becomes Ready, and then a
request flows through the pair, token for token equal to one engine's output."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvb_e2e import Api, wait_for
from sim import SimPod, create_agent_rbac, pod_bound_token
from vllm_harness import EngineProcess, pd_generate, running, vllm_python, write_model

from kvbridge_operator.config import ENDPOINTS

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.vllm, pytest.mark.slow]

SA = "kvbridge-agent"


@pytest.fixture
def engine_pods(cluster: Any, api: Api, ns: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    try:
        vllm_python()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    create_agent_rbac(cluster.api_client(), ns, SA)
    api.create_transfer(ns)
    model = write_model(tmp_path / "model", kind="llama", seed=9)
    engines: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        pod = SimPod(cluster, ns, f"vllm-{role}-0", role=role, engine_id=f"{ns}-{role}",
                     sa=SA).create_pod()
        token = pod_bound_token(cluster.kubectl, ns, SA, pod.name)
        kubeconfig = cluster.kubeconfig_for_token(token, f"pod-{ns}-{pod.name}")
        engines[role] = EngineProcess(
            model, tmp_path, connector="kvbridge", kv_role="kv_both",
            engine_id=pod.engine_id, name=pod.name,
            env={"POD_NAME": pod.name, "POD_UID": pod.uid, "POD_NAMESPACE": ns,
                 "NODE_NAME": pod.node, "POD_IP": "127.0.0.1", "KUBECONFIG": str(kubeconfig),
                 "KVBRIDGE_TRANSFER": "kvt", "KVBRIDGE_ROLE": role,
                 "KVBRIDGE_SYNC_INTERVAL_S": "0.5"})
    with running(engines):
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
    assert [(h["peer"], h["state"]) for h in status["handshakes"]] == [
        ("vllm-prefill-0", "Succeeded")]
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
