"""examples/serving/ on the real nodes: vLLM P/D pods answering over a verified pair, then the
chart's router in front of them (the gateway follows, in gateway.py)."""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from kvbridge_testkit import cluster as kc

from .common import NS, RELEASE, REPO, SYS_NS, say
from .gateway import show_gateway


def serve_vllm(cluster: kc.LocalCluster, images: dict[str, str], helm: Path) -> None:
    """examples/serving/ as written (the image is the local build): `vllm serve` with
    KVBridgeConnector in one prefill and two decode pods, then a completion in vLLM's P/D flow
    over a pair the operator made and the decode preflighted; then the chart's router in
    front of them, with a decode of another KV dtype that the operator refuses and the
    router never uses."""
    import yaml
    from kubernetes import client

    from kvbridge_testkit import vllm_pods as vp
    from kvbridge_testkit.sim import wait_until

    core = client.CoreV1Api(cluster.api_client())
    custom = client.CustomObjectsApi(cluster.api_client())
    image = images["KVB_IMAGE_VLLM"]
    docs = vp.manifests(image, images["KVB_IMAGE_OPERATOR"])
    t0 = time.monotonic()
    for stem in ("kvtransfer", "prefill", "decode"):
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(docs[stem]))
    bad = "tiny-llama-decode-bf16"
    core.create_namespaced_pod(NS, vp.incompatible_decode(docs["decode"], bad))
    say(f"applied examples/serving/ (KVTransfer {vp.TRANSFER}; Deployments {vp.TRANSFER}-prefill "
        f"x1 and {vp.TRANSFER}-decode x2 running `vllm serve` with KVBridgeConnector; image "
        f"{image}) ...")

    # The incompatible decode is a variant pod, which serving_pods leaves out.
    try:
        ready = wait_until(lambda: vp.serving_pods(core, NS), timeout=420, interval=2,
                           what="vLLM pods Ready")
    except Exception:
        say(f"vLLM pods not Ready; their containers:\n{vp.pod_report(core, NS)}")
        raise
    say(f"vLLM pods Ready {time.monotonic() - t0:.0f} s after apply: "
        f"{', '.join(p.metadata.name for ps in ready.values() for p in ps)}")

    def endpoint(name: str) -> dict[str, Any]:
        return custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS,
                                                   "kvendpoints", name)  # fmt: skip

    def verified(decode: Any) -> dict[str, Any]:
        status = endpoint(decode.metadata.name).get("status") or {}
        ok = status.get("peers") and all(h["state"] == "Succeeded"
                                         for h in status.get("handshakes", [])) \
            and status.get("handshakes")
        return status if ok else {}

    prefill, decode = ready["prefill"][0], ready["decode"][0]
    status = wait_until(lambda: verified(decode), timeout=120, what="decode preflighted")
    shake = status["handshakes"][0]
    say(f"operator paired {decode.metadata.name} with {status['peers'][0]['name']}; the decode "
        f"preflighted it (epoch {shake['epoch']}: {shake['state']})")
    prompt = vp.prompts(1, seed=5)[0]
    try:
        single = vp.complete(prefill.status.pod_ip, prompt, 12)["choices"][0]["token_ids"]
        before = vp.PullCounters.of(decode.status.pod_ip)
        result = vp.pd_complete(prefill.status.pod_ip, decode.status.pod_ip, prompt, 12)
    except vp.EngineError:
        for pod in (prefill, decode):
            log = cluster.kubectl("logs", "-n", NS, pod.metadata.name, "-c", "vllm",
                                  check=False).stdout.splitlines()
            say(f"{pod.metadata.name} failed; its log:\n" + "\n".join(
                line for line in log if "GET /health" not in line and "GET /metrics" not in line
            )[-5000:])
        raise
    after = vp.PullCounters.of(decode.status.pod_ip)
    say(f"completion served by the pair {prefill.metadata.name} (prefill, "
        f"{result.kv_transfer_params['remote_host']}:{result.kv_transfer_params['remote_port']}) "
        f"-> {decode.metadata.name} (decode): {result.prompt_tokens} prompt tokens, "
        f"{after.external_hit_tokens - before.external_hit_tokens:.0f} of them pulled over NIXL "
        f"({after.transfer_bytes - before.transfer_bytes:.0f} bytes), not recomputed; tokens "
        f"{result.token_ids} {'==' if result.token_ids == single else '!='} one engine's "
        f"{single}")
    if result.token_ids != single:
        raise RuntimeError("P/D tokens differ from one engine's")
    # Time to the first token of fresh prompts (no prefix cached anywhere): one engine alone
    # against the P/D pair (the prefill's answer, then the decode's first token).
    alone, pd = [], []
    for one, two in zip(vp.prompts(5, seed=77), vp.prompts(5, seed=78), strict=True):
        started = time.perf_counter()
        vp.complete(ready["decode"][1].status.pod_ip, one, 1, vp.DECODE_HTTP_PORT)
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        vp.pd_complete(prefill.status.pod_ip, decode.status.pod_ip, two, 1)
        pd.append(time.perf_counter() - started)
    say(f"time to first token, median of {len(pd)} fresh prompts each: one engine "
        f"{statistics.median(alone) * 1e3:.0f} ms, P/D pair {statistics.median(pd) * 1e3:.0f} "
        "ms (two HTTP calls, a KV pull; CPU engines sharing this machine's cores)")
    show_router(cluster, helm, core, bad)
    show_gateway(cluster, helm, core, images["KVB_IMAGE_ENVOY"])


def show_router(cluster: kc.LocalCluster, helm: Path, core: Any, bad: str) -> None:
    """The chart's router in front of the KVTransfer: requests take verified pairs only."""
    from concurrent.futures import ThreadPoolExecutor

    from kubernetes import client

    from kvbridge_testkit import vllm_pods as vp
    from kvbridge_testkit.sim import wait_until

    custom = client.CustomObjectsApi(cluster.api_client())

    def refused() -> dict[str, Any]:
        st = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvendpoints",
                                                 bad).get("status") or {}  # fmt: skip
        return st if st.get("state") == "Incompatible" else {}

    st = wait_until(refused, timeout=300, interval=2, what=f"{bad} refused")
    say(f"{bad} (KV cache in bfloat16) refused: {st['reason']}: {st['message'][:200]}")
    say(f"helm upgrade --set router.enabled=true,router.transfer={vp.TRANSFER},"
        f"router.namespace={NS} ...")
    subprocess.run(
        [str(helm), "upgrade", RELEASE, str(REPO / "charts" / "kvbridge"), "--kubeconfig",
         str(cluster.kubeconfig), "-n", SYS_NS, "--reuse-values", "--set", "router.enabled=true",
         "--set", f"router.transfer={vp.TRANSFER}", "--set", f"router.namespace={NS}",
         # One router pod (the chart runs two): its counters, read through the Service, are
         # then every request's.
         "--set", "router.replicas=1",
         "--wait", "--timeout=180s"], check=True, capture_output=True, text=True, timeout=240)
    service = core.read_namespaced_service(f"{RELEASE}-router", NS)
    router = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
    health = wait_until(lambda: vp.get_json(f"{router}/health").get("verifiedPairs"),
                        timeout=60, what="the router's Service")
    say(f"router Ready behind Service {RELEASE}-router ({router}): {health} verified pairs")
    prompts = vp.prompts(4, seed=31) * 3
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: vp.routed_complete(router, p, 8), prompts))
    ok = sum(1 for a in answers if len(a["choices"][0]["token_ids"]) == 8)
    endpoints = custom.list_namespaced_custom_object("kvbridge.io", "v1alpha1", NS,
                                                     "kvendpoints")["items"]  # fmt: skip
    pods = {e["spec"]["engineId"]: e["spec"]["podName"] for e in endpoints}
    served = vp.router_series(router, "kvbridge_router_requests_total")
    pairs = ", ".join(f"{pods.get(lb['prefill'])} -> {pods.get(lb['decode'])}: {n:.0f}"
                      for lb, n in served if lb["outcome"] == "answered" and lb["decode"])
    bad_ip = core.read_namespaced_pod(bad, NS).status.pod_ip
    bad_requests = vp.metric_sum(vp.scrape(bad_ip, vp.DECODE_HTTP_PORT),
                                 "vllm:request_success_total")  # fmt: skip
    say(f"{ok} of {len(prompts)} requests through the router (4 at a time) answered, by pair: "
        f"{pairs}; {bad} received {bad_requests:.0f}")
    core.delete_namespaced_pod(bad, NS, grace_period_seconds=0)
    wait_until(lambda: bad not in {
        e["metadata"]["name"] for e in custom.list_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints")["items"]},
        timeout=60, what=f"{bad}'s KVEndpoint gone")
    say(f"removed pod {bad}; KVTransfer {vp.TRANSFER} keeps serving over its verified pairs")
