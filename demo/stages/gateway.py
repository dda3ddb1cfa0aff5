"""The inference-gateway path on the real nodes: the chart's endpoint picker and InferencePool
behind an Envoy pod."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kvbridge_testkit import cluster as kc

from .common import NS, RELEASE, REPO, SYS_NS, say


def show_gateway(cluster: kc.LocalCluster, helm: Path, core: Any, envoy_image: str) -> None:
    """The inference-gateway path: the chart's endpoint picker and InferencePool, and an Envoy
    pod configured as a Gateway controller configures it for the pool, in front of the decode
    pods' sidecars; each request's answer names the verified pair that served it."""
    from kubernetes import client

    from kvbridge_testkit import vllm_pods as vp
    from kvbridge_testkit.envoy import bootstrap
    from kvbridge_testkit.sim import wait_until

    pool_values = ["--set", "gateway.enabled=true", "--set", f"gateway.transfer={vp.TRANSFER}",
                   "--set", f"gateway.namespace={NS}",
                   "--set", f"gateway.inferencePool.matchLabels.app\\.kubernetes\\.io/name="
                   f"{vp.TRANSFER}",
                   "--set", "gateway.inferencePool.matchLabels.kvbridge\\.io/role=decode",
                   "--set", "gateway.installInferencePoolCRD=true"]  # fmt: skip
    say(f"helm upgrade --set gateway.enabled=true,gateway.transfer={vp.TRANSFER},"
        "gateway.installInferencePoolCRD=true ... (twice: the InferencePool's API exists once "
        "its CRD is installed)")
    for _ in range(2):
        subprocess.run(
            [str(helm), "upgrade", RELEASE, str(REPO / "charts" / "kvbridge"), "--kubeconfig",
             str(cluster.kubeconfig), "-n", SYS_NS, "--reuse-values", *pool_values, "--wait",
             "--timeout=180s"], check=True, capture_output=True, text=True, timeout=240)
    pool = client.CustomObjectsApi(cluster.api_client()).get_namespaced_custom_object(
        "inference.networking.k8s.io", "v1", NS, "inferencepools", vp.TRANSFER)
    ref = pool["spec"]["endpointPickerRef"]
    say(f"InferencePool {vp.TRANSFER}: decode pods {pool['spec']['selector']['matchLabels']} "
        f"at port {pool['spec']['targetPorts'][0]['number']} (their sidecars), endpoint picker "
        f"Service {ref['name']}:{ref['port']['number']}, {ref['failureMode']}")
    picker = core.read_namespaced_service(ref["name"], NS).spec.cluster_ip
    config = bootstrap(8080, 9901, ref["port"]["number"], listen_host="0.0.0.0",
                       picker_host=picker)
    core.create_namespaced_config_map(NS, {"metadata": {"name": "gateway-envoy"},
                                           "data": {"envoy.json": json.dumps(config)}})
    core.create_namespaced_pod(NS, {
        "metadata": {"name": "gateway-envoy", "labels": {"app": "gateway-envoy"}},
        "spec": {"containers": [{
            "name": "envoy", "image": envoy_image, "imagePullPolicy": "Never",
            "args": ["-c", "/etc/envoy/envoy.json", "--concurrency", "1", "--log-level", "warn"],
            "ports": [{"containerPort": 8080}],
            "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy"}]}],
            "volumes": [{"name": "config", "configMap": {"name": "gateway-envoy"}}]}})
    envoy = wait_until(lambda: vp.pod_ready(p := core.read_namespaced_pod("gateway-envoy", NS))
                       and p, timeout=120, interval=1, what="the Envoy pod Ready")
    gateway = f"http://{envoy.status.pod_ip}:8080"
    say(f"Envoy 1.40 pod Ready ({gateway}): ext_proc to the picker (full-duplex streamed "
        "bodies, as the inference extension configures it), then the destination it names")
    endpoints = client.CustomObjectsApi(cluster.api_client()).list_namespaced_custom_object(
        "kvbridge.io", "v1alpha1", NS, "kvendpoints")["items"]
    pods = {e["spec"]["engineId"]: e["spec"]["podName"] for e in endpoints}
    prefill_ip = vp.role_pods(core, NS, "prefill")[0].status.pod_ip
    for prompt in vp.prompts(4, seed=61):
        single = vp.complete(prefill_ip, prompt, 8)["choices"][0]["token_ids"]
        tokens, pair = wait_until(lambda p=prompt: vp.post_with_header(
            f"{gateway}/v1/completions", vp.completion(p, 8), "x-kvbridge-pair"), timeout=60,
            interval=1, what="an answer through the gateway")
        prefill, decode = pair.split("->")
        say(f"through the gateway: served by {pods.get(prefill, prefill)} -> "
            f"{pods.get(decode, decode)}; tokens {'==' if tokens == single else '!='} one "
            "engine's")
        if tokens != single:
            raise RuntimeError("tokens through the gateway differ from one engine's")
