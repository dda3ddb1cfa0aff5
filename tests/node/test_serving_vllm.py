"""vLLM serving pods on the real node: examples/serving/ applied as written (only the image
is the local build), `vllm serve` with KVBridgeConnector from the one flag in one prefill and
two decode pods. Each publishes its KVEndpoint from the geometry it registered, the operator
pairs them, each decode preflights its prefill, the KVTransfer goes Ready, and requests in
vLLM's P/D flow, sent to the pods' HTTP ports, give one engine's greedy tokens with the prompt
pulled, not recomputed. A decode with another block size is refused before any request; the
prefill pod deleted is replaced by its Deployment, preflighted again, and serves again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from chartlib import CHART, Kube
from nodelib import AGENT_NS, OPERATOR_NS, RELEASE

from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.e2e import Api, wait_for

# The first test's time includes starting the vLLM pods (two or three minutes on 2 cores).
pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.nixl, pytest.mark.vllm,
              pytest.mark.slow, pytest.mark.timeout(900)]  # fmt: skip
log = logging.getLogger(__name__)

NS, T = AGENT_NS, vp.TRANSFER
MAX_TOKENS = 8
BAD = "tiny-llama-decode-bad"
REGIONS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def role_pods(api: Api, role: str) -> list[Any]:
    return vp.role_pods(api.core, NS, role)


def serving_pods(api: Api) -> dict[str, list[Any]] | None:
    return vp.serving_pods(api.core, NS)


def restarts(pod: Any) -> int:
    return sum(c.restart_count for c in pod.status.container_statuses or [])


def preflighted_by(api: Api, decode: str, prefill: str) -> dict[str, Any] | None:
    """The decode's KVEndpoint once the operator gave it ``prefill`` as its only peer and
    its agent reports the handshake with that peer's current epoch Succeeded."""
    ep = api.endpoint(NS, decode)
    status = ep.get("status") or {}
    epoch = api.endpoint(NS, prefill)["spec"]["epoch"]
    peers = [p["name"] for p in status.get("peers", [])]
    shakes = {(h["peer"], h["epoch"]): h["state"] for h in status.get("handshakes", [])}
    return ep if peers == [prefill] and shakes.get((prefill, epoch)) == "Succeeded" else None


def describe(kube: Kube) -> str:
    pods = kube.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
    events = kube.kubectl("get", "events", "-n", NS, "--sort-by=.lastTimestamp",
                          check=False).stdout  # fmt: skip
    return f"{pods}\n{events[-3000:]}"


@pytest.fixture(scope="module")
def serving(api: Api, kube: Kube, release: str, images: dict[str, str]
            ) -> Iterator[dict[str, dict[str, Any]]]:  # fmt: skip
    docs = vp.manifests(images["KVB_IMAGE_VLLM"], images["KVB_IMAGE_OPERATOR"])
    started = time.monotonic()
    for stem in ("kvtransfer", "prefill", "decode"):
        kube.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(docs[stem]))
    try:
        wait_for(lambda: serving_pods(api), timeout=420, interval=2,
                 what="one prefill and two decode vLLM pods Ready")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(kube)}") from None
    log.info("vLLM pods Ready %.1f s after apply", time.monotonic() - started)
    yield docs
    for kind, name in (("pod", BAD), ("deployment", f"{T}-prefill"),
                       ("deployment", f"{T}-decode"), ("kvtransfer", T)):  # fmt: skip
        kube.kubectl("delete", kind, name, "-n", NS, "--ignore-not-found", "--wait=false")
    # The node's memory and cores go back before the next module's tests.
    wait_for(lambda: not api.core.list_namespaced_pod(
        NS, label_selector=f"app.kubernetes.io/name={T}").items, timeout=120, interval=1,
        what="the vLLM pods gone")  # fmt: skip


@pytest.fixture(scope="module")
def references(serving: dict[str, Any], api: Api) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from one engine computing it alone (the prefill pod)."""
    ip = role_pods(api, "prefill")[0].status.pod_ip
    return {p: vp.complete(ip, p, MAX_TOKENS)["choices"][0]["token_ids"]
            for p in vp.prompts(4, seed=22)}  # fmt: skip


def test_vllm_pods_publish_pair_preflight_and_go_ready(api: Api, node: Any,
                                                       serving: dict[str, Any]) -> None:
    pods = serving_pods(api)
    assert pods is not None
    (prefill,), decodes = pods["prefill"], pods["decode"]
    for pod in (prefill, *decodes):
        assert pod.spec.node_name == node.name
        assert restarts(pod) == 0, f"{pod.metadata.name} restarted"
    endpoints = wait_for(lambda: (lambda e: e if {p.metadata.name for p in (prefill, *decodes)}
                                  <= set(e) else None)(api.endpoints(NS)),
                         timeout=60, what="the vLLM pods' KVEndpoints")  # fmt: skip
    for pod in (prefill, *decodes):
        spec = endpoints[pod.metadata.name]["spec"]
        assert spec["transferName"] == T
        # The pod's labels, from its downwardAPI file: the KVTransfer's selectors match them.
        labels = endpoints[pod.metadata.name]["metadata"]["labels"]
        assert pod.metadata.labels.items() <= labels.items()
        assert spec["role"] == pod.metadata.labels["kvbridge.io/role"]
        assert spec["sideChannel"] == {"host": pod.status.pod_ip, "port": 5600}
        geometry = spec["geometry"]   # what vLLM registered, not what a manifest says
        assert [r["name"] for r in geometry["regions"]] == REGIONS
        assert (geometry["blockSize"], geometry["attentionBackend"],
                geometry["kvCacheLayout"]) == (32, "CPU_ATTN", "LBHNC")  # fmt: skip
    for decode in decodes:
        wait_for(lambda d=decode: preflighted_by(api, d.metadata.name, prefill.metadata.name),
                 timeout=120, what=f"{decode.metadata.name} preflighted the prefill")
    api.wait_condition(NS, "Ready", "True", name=T, timeout=120)


def test_pd_requests_give_one_engines_tokens_with_the_prompt_pulled(
        api: Api, serving: dict[str, Any], references: dict[str, list[int]]) -> None:
    prefill = role_pods(api, "prefill")[0].status.pod_ip
    for decode in role_pods(api, "decode"):
        ip = decode.status.pod_ip
        before = vp.PullCounters.of(ip)
        prompt_tokens = 0
        for prompt, reference in references.items():
            result = vp.pd_complete(prefill, ip, prompt, MAX_TOKENS)
            assert result.token_ids == reference, (decode.metadata.name, prompt)
            assert result.kv_transfer_params["remote_host"] == prefill
            prompt_tokens += result.prompt_tokens
        after = vp.PullCounters.of(ip)
        # Every prompt token but at most the last of each prompt came from the prefill.
        loaded = after.external_hit_tokens - before.external_hit_tokens
        assert prompt_tokens - len(references) <= loaded <= prompt_tokens, (loaded,
                                                                              prompt_tokens)
        assert after.transfer_bytes > before.transfer_bytes
        assert after.transfer_failures == before.transfer_failures


def test_incompatible_decode_is_refused_before_any_request(
        api: Api, serving: dict[str, Any]) -> None:
    api.core.create_namespaced_pod(NS, vp.incompatible_decode(serving["decode"], BAD))

    def refused() -> dict[str, Any] | None:
        try:
            status = api.endpoint(NS, BAD).get("status") or {}
        except Exception:
            return None
        return status if status.get("state") == "Incompatible" else None

    status = wait_for(refused, timeout=300, interval=2, what=f"{BAD} refused")
    # Refused by the rule the handshake applies, the field named: the KV dtype enters vLLM's
    # compatibility hash.
    assert status["message"].startswith("spec.compatibilityHash: incompatible"), status
    assert not status.get("peers")
    prefill = role_pods(api, "prefill")[0].metadata.name
    assert BAD not in {p["name"] for p in api.endpoint(NS, prefill)["status"].get("peers", [])}
    # It publishes while vLLM starts; its HTTP server answers once it is Ready.
    pod = wait_for(lambda: (lambda p: p if vp.pod_ready(p) else None)(
        api.core.read_namespaced_pod(BAD, NS)), timeout=300, interval=2, what=f"{BAD} Ready")
    counters = vp.PullCounters.of(pod.status.pod_ip)
    assert counters.external_hit_tokens == 0 and counters.transfer_bytes == 0
    # It stays up for the router's tests: it must never receive a request.


# -- the router (kvbridge-router from the chart) in front of these pods ------------------------
@pytest.fixture(scope="module")
def router(serving: dict[str, Any], api: Api, kube: Kube) -> Iterator[str]:
    """The chart's router for the example KVTransfer; yields its Service's base URL. One
    router pod (the chart runs two): the tests read its counters through the Service."""
    kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
              "--set", "router.enabled=true", "--set", f"router.transfer={T}",
              "--set", f"router.namespace={NS}", "--set", "router.replicas=1",
              "--wait", "--timeout=180s", timeout=240)  # fmt: skip
    service = api.core.read_namespaced_service(f"{RELEASE}-router", NS)
    url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
    wait_for(lambda: vp.http_ok(f"{url}/health"), timeout=60, what="the router's Service")
    yield url
    kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
              "--set", "router.enabled=false", timeout=240)  # fmt: skip


def test_router_sends_concurrent_requests_over_verified_pairs_only(
        api: Api, router: str, references: dict[str, list[int]]) -> None:
    bad_ip = api.core.read_namespaced_pod(BAD, NS).status.pod_ip
    health = vp.get_json(f"{router}/health")
    assert health == {"status": "ok", "verifiedPairs": 2}, health
    jobs = [prompt for prompt in references for _ in range(4)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: vp.routed_complete(router, p, MAX_TOKENS), jobs))
    assert [a["choices"][0]["token_ids"] for a in answers] == [references[p] for p in jobs]
    served = vp.router_series(router, "kvbridge_router_requests_total")
    pods = {e["spec"]["engineId"]: e["spec"]["podName"] for e in api.endpoints(NS).values()}
    by_decode = {pods[labels["decode"]]: n for labels, n in served
                 if labels["outcome"] == "answered" and labels["decode"]}  # fmt: skip
    decodes = {d.metadata.name for d in role_pods(api, "decode")}
    assert set(by_decode) == decodes and sum(by_decode.values()) == len(jobs), served
    # The refused decode never saw a request, through the router or otherwise.
    assert vp.metric_sum(vp.scrape(bad_ip, vp.DECODE_HTTP_PORT), "vllm:request_success_total") == 0


def test_openai_client_through_the_router(router: str, references: dict[str, list[int]]
                                          ) -> None:  # fmt: skip
    prompt, reference = next(iter(references.items()))
    vp.check_openai_client(router, prompt, reference, MAX_TOKENS)


def test_deleted_prefill_is_replaced_preflighted_and_serves(
        api: Api, serving: dict[str, Any], references: dict[str, list[int]]) -> None:
    api.core.delete_namespaced_pod(BAD, NS, grace_period_seconds=0)
    wait_for(lambda: BAD not in api.endpoints(NS), timeout=60, what=f"{BAD}'s endpoint gone")
    (old,) = role_pods(api, "prefill")
    old_epoch = api.endpoint(NS, old.metadata.name)["spec"]["epoch"]
    decodes = {d.metadata.name: d.metadata.uid for d in role_pods(api, "decode")}
    api.core.delete_namespaced_pod(old.metadata.name, NS)

    def replacement() -> Any:
        pods = [p for p in role_pods(api, "prefill") if p.metadata.name != old.metadata.name]
        return pods[0] if pods and vp.pod_ready(pods[0]) else None

    new = wait_for(replacement, timeout=300, interval=2, what="a new prefill pod Ready")
    new_epoch = wait_for(lambda: api.endpoint(NS, new.metadata.name)["spec"]["epoch"],
                         timeout=60, what="the new prefill's KVEndpoint")  # fmt: skip
    assert new_epoch != old_epoch
    for name in decodes:
        wait_for(lambda n=name: preflighted_by(api, n, new.metadata.name), timeout=120,
                 what=f"{name} preflighted the new prefill")
    api.wait_condition(NS, "Ready", "True", name=T, timeout=120)
    for decode in role_pods(api, "decode"):
        # The same pods, never restarted: no step needed a manual restart.
        assert decodes[decode.metadata.name] == decode.metadata.uid and restarts(decode) == 0
        for prompt, reference in references.items():
            result = vp.pd_complete(new.status.pod_ip, decode.status.pod_ip, prompt,
                                    MAX_TOKENS)  # fmt: skip
            assert result.token_ids == reference


def test_decode_deleted_under_load_never_answers_wrong_tokens(
        api: Api, router: str, references: dict[str, list[int]]) -> None:
    retries_before = sum(n for _, n in vp.router_series(router, "kvbridge_router_retries_total"))
    victim = role_pods(api, "decode")[0]
    with vp.routed_load(router, list(references), MAX_TOKENS) as load:
        wait_for(lambda: len(load.results) >= 8, timeout=120, what="requests flowing")
        api.core.delete_namespaced_pod(victim.metadata.name, NS, grace_period_seconds=0)
        wait_for(lambda: vp.get_json(f"{router}/health").get("verifiedPairs") == 1,
                 timeout=60, what="the router dropping the deleted decode's pair")
        settled = len(load.results)
        wait_for(lambda: len(load.results) >= settled + 8, timeout=120,
                 what="requests after it")  # fmt: skip
    answered, failed = load.answered, load.failed
    retries = sum(n for _, n in vp.router_series(router, "kvbridge_router_retries_total")) \
        - retries_before
    log.info("decode %s deleted under load: %d answered, %d failed, %d retried on another "
             "pair", victim.metadata.name, len(answered), len(failed), retries)
    assert [t for p, t in answered if t != references[p]] == []
    assert not failed, failed
    # The Deployment brings the decode back; the router takes it once it is verified.
    wait_for(lambda: serving_pods(api), timeout=300, interval=2, what="the decode replaced")
    wait_for(lambda: vp.get_json(f"{router}/health").get("verifiedPairs") == 2, timeout=180,
             interval=1, what="the router routing to the new decode")
