"""`make demo`: kvbridge end to end on this machine, in one command.

On a machine that can run one (root, cgroup v1, network namespaces), everything runs as it
would for a user: two real kubelet nodes in two zones on one pod network
(kvbridge_testkit.node) run the operator from the chart, unmodified, and the serving pods from
images built here (hack/node-images.sh). Where the nodes cannot start, the demo says why and
falls back to simulated pods: real Pod objects on a node simulator, each backed by an agent
process (demo/sim.py), with the operator as a local ``kopf run``. ``KVBRIDGE_DEMO=simulated``
(or ``node``) chooses explicitly.

1. ensure the binaries (hack/test-stack.sh ensure; the first run builds them, ~8 minutes, and
   on a real node the images, ~3 minutes), start etcd + kube-apiserver +
   kube-controller-manager (+ kube-scheduler, kubelet, kube-proxy and containerd);
2. install the Helm chart (real node: the operator Deployment from the local image, its
   webhook behind its Service; simulated: the operator as a local process with the chart's
   ServiceAccount token and a loopback webhook);
3. apply examples/demo-kvtransfer.yaml; start a prefill and a decode pod (real containers, the
   decode on the second node; or agent processes with real memory and real NIXL; pod-bound
   tokens either way);
4. show the pairing and the preflight handshakes, run a grouped + mixed-memory pull with
   byte-exact verification (across nodes, on real nodes), its throughput and the transport
   UCX chose;
5. show the admission webhook refusing a malformed KVEndpoint (tpRank >= tpSize) and a pod
   overwriting another pod's endpoint, with their messages;
6. start an incompatible decode pod and show the operator refusing it, with the reason;
7. print ``kubectl get pods`` and ``kubectl get kvtransfers,kvendpoints``; clean everything
   up (also on Ctrl-C).

With Prometheus installed (``make test-stack`` installs Debian's), a real Prometheus on this
machine (kvbridge_testkit.prometheus) scrapes the operator and the agents (on real nodes: the
pod IPs, which the host routes to each node) with the chart's alert rules: the demo prints its
scrape targets, and the KVBridgeTransferDegraded alert firing when the incompatible decode pod
joins and resolving when it is removed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "demo"), str(REPO / "agent"), str(REPO / "operator")]
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from kvbridge_testkit import cluster as kc  # noqa: E402

NS, SYS_NS, RELEASE = "kvbridge-demo", "kvbridge-system", "kvbridge"
OPERATOR_METRICS_PORT = 9090    # the chart's metrics.port
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def ensure_stack() -> kc.Binaries:
    """The control plane and node binaries (a second when cached; ~8 minutes the first time)."""
    if not os.environ.get("KVB_KUBE_APISERVER"):
        say("ensuring the control plane and node binaries (hack/test-stack.sh ensure; the "
            "first run builds Kubernetes v1.20.2 from Debian's source, ~8 minutes) ...")
        env = {**os.environ, "PYTHON": sys.executable}
        subprocess.run(["bash", str(REPO / "hack" / "test-stack.sh"), "ensure"], check=True,
                       env=env, stdout=subprocess.DEVNULL)
    return kc.Binaries.find()


def main() -> int:
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cleanup: list = []
    try:
        return run(cleanup)
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception as exc:
                print(f"cleanup: {exc}", file=sys.stderr)
        say("cleaned up (agents, operator, control plane)")


#: start_pod(name, role, engine_id, preset, seed, zone) -> (a pod handle with call/status,
#: where); zone None: wherever the scheduler puts it (on real nodes: the first node)
StartPod = Callable[[str, str, str, str, int, str | None], tuple[Any, str]]


@dataclass
class Stage:
    """Where the demo runs: the control plane, how a serving pod starts and goes, where the
    operator's metrics are, and (on a real node) vLLM serving pods."""

    cluster: kc.LocalCluster
    start_pod: StartPod
    #: host:port of the operator's metrics, where this machine's Prometheus scrapes them
    operator_metrics: str = ""
    #: stop a serving pod's agent and delete its Pod (name, the start_pod handle)
    delete_pod: Callable[[str, Any], None] = lambda name, handle: None
    #: vLLM serving pods answering a completion over a verified pair (a real node only)
    serve_vllm: Callable[[], None] | None = None


def run(cleanup: list) -> int:
    from kubernetes import client

    from kvbridge_testkit.sim import handshakes_ok, wait_until

    binaries = ensure_stack()
    mode = os.environ.get("KVBRIDGE_DEMO", "auto")
    if mode not in {"auto", "node", "simulated"}:
        raise SystemExit(f"KVBRIDGE_DEMO={mode!r}: expected auto, node or simulated")
    stage: Stage | None = None
    if mode != "simulated":
        try:
            stage = setup_node(binaries, cleanup)
        except Exception as exc:
            if mode == "node":
                raise
            say(f"a real node cannot run here ({type(exc).__name__}: {str(exc)[:300]}); "
                "falling back to simulated pods")
            for fn in reversed(cleanup):
                try:
                    fn()
                except Exception as cleanup_exc:
                    print(f"cleanup: {cleanup_exc}", file=sys.stderr)
            cleanup.clear()
    if stage is None:
        stage = setup_simulated(binaries, cleanup)
    cluster = stage.cluster
    prom = start_prometheus(stage, binaries, cleanup)
    started: dict[str, Any] = {}

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int,
                  zone: str | None = None) -> tuple[Any, str]:  # fmt: skip
        handle, where = stage.start_pod(name, role, engine, preset, seed, zone)
        started[name] = handle
        if prom is not None:
            scrape_agents(prom, started)
        return handle, where

    k = cluster.kubectl
    k("apply", "-n", NS, "-f", str(REPO / "examples" / "demo-kvtransfer.yaml"))
    say("applied examples/demo-kvtransfer.yaml (KVTransfer kvt)")

    sa = f"{RELEASE}-agent"
    p, where = start_pod("prefill-0", "prefill", "prefill-engine", "grouped", 42)
    say(f"pod prefill-0 Running: {where} (grouped regions)")
    # On real nodes the decode runs on the second node (zone-b): its pulls cross the pod network.
    d, where = start_pod("decode-0", "decode", "decode-engine", "mixed", 0, "zone-b")
    say(f"pod decode-0 Running: {where} (mixed regions)")

    wait_until(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=90,
               what="preflight handshakes")
    custom = client.CustomObjectsApi(cluster.api_client())
    for name in ("decode-0", "prefill-0"):
        st = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvendpoints",
                                                 name)["status"]
        hs = ", ".join(f"{h['peer']}@{h['epoch']}={h['state']}" for h in st["handshakes"])
        say(f"{name}: operator state {st['state']} peers "
            f"{[x['name'] for x in st['peers']]}; agent preflight: {hs}")

    def ready_cond() -> dict:
        t = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvtransfers",
                                                "kvt")
        return next((c for c in (t.get("status") or {}).get("conditions", [])
                     if c["type"] == "Ready" and c["status"] == "True"), {})

    cond = wait_until(ready_cond, timeout=60, what="KVTransfer Ready")
    say(f"KVTransfer kvt Ready: {cond['message']}")

    n = 64   # every block of both groups: 4 regions x 64 x 16 KiB, one region a DRAM pool
    local = [list(range(n)), list(range(n))]
    remote = [list(reversed(range(n))), list(range(n))]
    rates = []
    for i in range(5):
        rid = f"demo-{i}"
        p.call("hold", request_ids=[rid])
        d.call("clear")
        res = d.call("pull", request_id=rid, remote_engine_id="prefill-engine",
                     local_block_ids=local, remote_block_ids=remote, verify_seed=42)
        if not (res["ok"] and res["verified"]):
            say(f"transfer {rid} FAILED: {res}")
            return 1
        wait_until(lambda rid=rid: rid in p.call("completions")["finished"], timeout=10,
                   what=f"{rid} completion at the prefill")
        rates.append(res["gbps"])
    say(f"grouped + mixed-memory pull: {res['nbytes'] / 2**20:.1f} MiB, {res['descs']} "
        f"descriptors in {res['parts']} parts (VRAM<-VRAM and DRAM<-VRAM), byte-exact; "
        f"median {statistics.median(rates):.2f} GB/s over {len(rates)} requests; "
        "prefill got every completion notification")
    hs = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvendpoints",
                                             "decode-0")["status"]["handshakes"]
    say("UCX reaches prefill-0 over " + ", ".join(
        f"{h.get('transport', '?')} ({h.get('transportDetail', '')})" for h in hs)
        + " (KVEndpoint decode-0 status.handshakes[].transport, as UCX selected it)")
    if prom is not None:
        show_targets(prom, 1 + len(started))

    show_admission(cluster, custom, sa)
    if stage.serve_vllm is not None:
        stage.serve_vllm()
    else:
        say("vLLM serving pods need the real node; skipped with simulated pods")

    start_pod("decode-bad", "decode", "decode-bad", "bad-block", 0)
    say("started decode-bad (block length 8 KiB instead of 16 KiB) ...")

    def refused() -> dict:
        st = custom.get_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints", "decode-bad").get("status") or {}
        return st if st.get("state") == "Incompatible" else {}

    st = wait_until(refused, timeout=60, what="decode-bad refused")
    say(f"decode-bad refused: {st['reason']}: {st['message'][:300]}")
    if prom is not None:
        show_alert(prom, stage, started)

    print(k("get", "pods", "-A", "-o", "wide").stdout, flush=True)
    print(k("get", "kvtransfers,kvendpoints", "-n", NS, "-o", "wide").stdout, flush=True)
    say("demo finished")
    return 0


def setup_node(binaries: kc.Binaries, cleanup: list) -> Stage:
    """Two real nodes on one pod network; the chart's operator Deployment and the serving
    pods run as containers."""
    from kubernetes import client

    from kvbridge_testkit import node as kn
    from kvbridge_testkit.node_pods import (
        NodePod,
        agent_pod,
        image_values,
        in_zone,
        ready_pod,
        two_nodes,
    )
    from kvbridge_testkit.sim import wait_until

    node_binaries = kn.NodeBinaries.find()
    say("node images: operator and agent from the Dockerfile, built with buildah over a Debian "
        "base (hack/node-images.sh; ~3 minutes the first time, then cached) ...")
    images = kn.node_images(build=True)
    nodes = two_nodes(images, binaries=node_binaries)
    cleanup.append(lambda: kn.stop_all(nodes))  # also when the cluster never comes up
    for node in nodes:
        node.link_up()
    say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler ...")
    cluster = kc.LocalCluster(binaries=binaries, address=kn.HOST_IP, real_nodes=True,
                              service_cidr=kn.SERVICE_CIDR).start()
    cleanup.append(cluster.stop)
    say("starting two nodes: containerd, kubelet and kube-proxy, each in network and mount "
        "namespaces of their own, one pod network over both ...")
    cleanup.append(lambda: kn.stop_all(nodes))  # before the apiserver goes: pods go through it
    kn.start_all(nodes, cluster)
    k = cluster.kubectl
    for node in nodes:
        labels = ", ".join(f"{key}={value}" for key, value in node.labels.items())
        say(f"node {node.name} Ready ({labels}"
            f"{', tainted ' + ' '.join(node.taints) if node.taints else ''}; pods in "
            f"{node.net.pod_cidr}; images {', '.join(node.image_names()[:3])})")
    say(f"control plane up at {cluster.server} (kubelet {kc.KUBE_VERSION})")

    k("create", "namespace", NS)
    values = image_values(images["KVB_IMAGE_OPERATOR"])
    say(f"helm install kvbridge charts/kvbridge {' '.join(values)} --wait ...")
    subprocess.run(
        [str(binaries.helm), "install", RELEASE, str(REPO / "charts" / "kvbridge"),
         "--kubeconfig", str(cluster.kubeconfig), "-n", SYS_NS, "--create-namespace",
         *values, "--set", f"agent.namespaces={{{NS}}}", "--wait", "--timeout=180s"],
        check=True, capture_output=True, text=True, timeout=240)
    wait_webhook_answering(cluster)
    say("operator Deployment Ready (non-root, read-only root filesystem, in-cluster token); "
        "the apiserver calls its admission webhook through the kvbridge-webhook Service")
    core = client.CoreV1Api(cluster.api_client())

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int, zone: str | None
                  ) -> tuple[Any, str]:  # fmt: skip
        pod = agent_pod(name, role, images["KVB_IMAGE_AGENT"], engine_id=engine, preset=preset,
                        seed=seed, service_account=f"{RELEASE}-agent")
        core.create_namespaced_pod(NS, in_zone(pod, zone) if zone else pod)
        pod = wait_until(lambda: ready_pod(core, NS, name), timeout=120, interval=0.5,
                         what=f"pod {name} Ready")
        handle = NodePod(name, pod.status.pod_ip, engine_id=engine, preset=preset)
        status = handle.status()
        return handle, (f"container on {pod.spec.node_name}, pod IP {pod.status.pod_ip}, "
                        f"agent epoch {status['epoch']} side channel port {status['port']}")

    def delete_pod(name: str, _handle: Any) -> None:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)

    # The host routes the pod network to the node: Prometheus here scrapes pod IPs directly.
    (operator,) = [p for p in core.list_namespaced_pod(SYS_NS).items
                   if p.status.phase == "Running"]
    return Stage(cluster, start_pod,
                 operator_metrics=f"{operator.status.pod_ip}:{OPERATOR_METRICS_PORT}",
                 delete_pod=delete_pod,
                 serve_vllm=lambda: serve_vllm(cluster, images, binaries.helm))


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


def setup_simulated(binaries: kc.Binaries, cleanup: list) -> Stage:
    """A node simulator; the operator is a local process and each pod an agent process."""
    from kvbridge_testkit.sim import SimPod

    say("starting etcd, kube-apiserver, kube-controller-manager ...")
    cluster = kc.LocalCluster(binaries=binaries).start()
    cleanup.append(cluster.stop)
    kubelet = kc.FakeKubelet(cluster.api_client(), {"node-a": {}}).start()
    cleanup.append(kubelet.stop)
    k = cluster.kubectl
    say(f"control plane up at {cluster.server}; node simulator registered node-a")

    k("create", "namespace", NS)
    say("helm install kvbridge charts/kvbridge (CRDs, RBAC, agent ServiceAccount) ...")
    subprocess.run(
        [str(binaries.helm), "install", RELEASE, str(REPO / "charts" / "kvbridge"),
         "--kubeconfig", str(cluster.kubeconfig), "-n", SYS_NS, "--create-namespace",
         "--set", "operator.replicas=0", "--set", "webhook.enabled=false",
         "--set", f"agent.namespaces={{{NS}}}", "--wait=false"],
        check=True, capture_output=True, text=True, timeout=120)
    k("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")

    say("starting the operator (kopf run, chart's operator ServiceAccount token, admission "
        "webhook on loopback TLS) ...")
    token = k("create", "token", RELEASE, "-n", SYS_NS, "--duration=3600s").stdout.strip()
    kubeconfig = cluster.kubeconfig_for_token(token, "operator")
    ports = {k: kc.free_port() for k in ("liveness", "webhook", "metrics")}
    from kvbridge_operator.webhook import self_signed_certificate
    from kvbridge_testkit.operator_process import OperatorProcess, loopback_settings

    cert, key = self_signed_certificate(Path(cluster.workdir) / "webhook",
                                        ["127.0.0.1", "localhost"])
    op = OperatorProcess(
        kubeconfig, Path(cluster.workdir),
        {"KVBRIDGE_PEERING": "", **loopback_settings(ports, cert, key),
         "KVBRIDGE_DEBOUNCE": "0.1", "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'agent'}"},
        ports, log_name="operator.log", stop_timeout=15)
    cleanup.append(op.stop)
    try:
        op.start()
    except AssertionError as exc:
        raise SystemExit(f"the operator did not start ({str(exc).splitlines()[0]}); see its "
                         f"log in {op.log_path}") from None
    webhook_port, metrics_port = ports["webhook"], ports["metrics"]
    register_webhook(cluster, webhook_port, Path(cert).read_bytes(), cleanup)
    say(f"admission webhook registered (https://127.0.0.1:{webhook_port}, "
        "ValidatingWebhookConfiguration kvbridge-validation) and answering")

    pods: list[SimPod] = []
    cleanup.append(lambda: [p.close() for p in pods])

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int,
                  _zone: str | None) -> tuple[Any, str]:  # fmt: skip
        """Every simulated pod on the one simulated node (the zone is for real nodes)."""
        pod = SimPod(cluster, NS, name, role=role, engine_id=engine, preset=preset,
                     seed=seed, sa=f"{RELEASE}-agent", extra_args=["--metrics-port", "0"])
        pods.append(pod)
        ready = pod.start()
        return pod, (f"agent process pid {ready['pid']} epoch {ready['epoch']} side channel "
                     f"127.0.0.1:{ready['port']}, metrics 127.0.0.1:{ready['metrics_port']}")

    def delete_pod(_name: str, pod: SimPod) -> None:
        pod.close()
        pod.delete_pod()

    return Stage(cluster, start_pod, operator_metrics=f"127.0.0.1:{metrics_port}",
                 delete_pod=delete_pod)


def start_prometheus(stage: Stage, binaries: kc.Binaries, cleanup: list) -> Any:
    """A Prometheus on loopback scraping the operator (and, as pods start, the agents) with
    the chart's alerts; None, saying why, where it cannot run."""
    from kvbridge_testkit import prometheus as kp

    try:
        prom_binaries = kp.PromBinaries.find()
    except kp.PrometheusMissingError as exc:
        say(f"Prometheus stage skipped: {exc}")
        return None
    rules = kp.chart_rules(binaries.helm, kp.FAST_ALERTS)
    prom = kp.Prometheus(prom_binaries, kp.JOBS, rules=rules,
                         workdir=Path(stage.cluster.workdir) / "prometheus").start()
    cleanup.append(prom.stop)
    prom.set_targets(kp.OPERATOR_JOB, [(stage.operator_metrics, {"namespace": SYS_NS})])
    say(f"Prometheus {prom.url} (Debian's prometheus, temporary config and TSDB) scrapes the "
        f"operator and the agents every {prom.interval}; {len(kp.alert_rules(rules))} alert "
        "rules from the chart's PrometheusRule, `for` shortened to 2s")
    return prom


def scrape_agents(prom: Any, started: dict[str, Any]) -> None:
    """Scrape every started agent that serves metrics, labelled as a PodMonitor would."""
    from kvbridge_testkit.prometheus import AGENT_JOB

    prom.set_targets(AGENT_JOB, [
        (h.metrics_target, {"namespace": NS, "pod": name})
        for name, h in started.items() if h.metrics_target])


def show_targets(prom: Any, count: int) -> None:
    from kvbridge_testkit.sim import wait_until

    def up() -> list[dict]:
        ts = prom.targets()
        return ts if len(ts) == count and all(t["health"] == "up" for t in ts) else []

    for t in sorted(wait_until(up, timeout=60, interval=0.5, what="scrape targets up"),
                    key=lambda t: (t["labels"]["job"], t["labels"].get("pod", ""))):
        labels = t["labels"]
        say(f"  scrape target {labels['job']:<16} {t['scrapeUrl']:<34} {t['health']} "
            f"{labels.get('pod', '')}")


def follow_alert(prom: Any, name: str, target: str, timeout: float = 120) -> None:
    """Print the alert's state for KVTransfer kvt as it changes, until it is ``target``."""
    from kvbridge_testkit.sim import wait_until

    seen: list[str] = []

    def reached() -> bool:
        state = prom.alert_state(name, namespace=NS, transfer="kvt")
        if not seen or seen[-1] != state:
            seen.append(state)
            say(f"  alert {name} {{namespace={NS}, transfer=kvt}}: {state}")
        return state == target

    wait_until(reached, timeout=timeout, interval=0.25, what=f"{name} {target}")


def show_alert(prom: Any, stage: Stage, started: dict[str, Any]) -> None:
    """decode-bad makes KVBridgeTransferDegraded fire; removing it resolves it."""
    from kubernetes import client

    from kvbridge_testkit.sim import wait_until

    follow_alert(prom, "KVBridgeTransferDegraded", "firing")
    (alert,) = [a for a in prom.alerts() if a["state"] == "firing" and
                a["labels"]["alertname"] == "KVBridgeTransferDegraded" and
                a["labels"].get("transfer") == "kvt"]
    say(f"  summary: {alert['annotations']['summary']}")
    stage.delete_pod("decode-bad", started.pop("decode-bad"))
    scrape_agents(prom, started)
    say("removed pod decode-bad (its KVEndpoint is garbage-collected with it) ...")
    custom = client.CustomObjectsApi(stage.cluster.api_client())
    wait_until(lambda: "decode-bad" not in {
        e["metadata"]["name"] for e in custom.list_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints")["items"]},
        timeout=60, what="decode-bad's KVEndpoint gone")
    follow_alert(prom, "KVBridgeTransferDegraded", "inactive")
    say("  KVBridgeTransferDegraded resolved: the KVTransfer is no longer Degraded")


def register_webhook(cluster: kc.LocalCluster, port: int, ca: bytes, cleanup: list) -> None:
    """Register the ValidatingWebhookConfiguration of the (started, listening) operator's
    webhook (URL form, the caller's CA) and wait until the apiserver calls it."""
    from kubernetes import client

    from kvbridge_operator.webhook import webhook_configuration

    reg = client.AdmissionregistrationV1Api(cluster.api_client())
    reg.create_validating_webhook_configuration(webhook_configuration(
        "kvbridge-validation", ca, url=f"https://127.0.0.1:{port}"))

    def unregister() -> None:   # before the operator stops: no write waits on a dead webhook
        reg.delete_validating_webhook_configuration("kvbridge-validation")

    cleanup.append(unregister)
    wait_webhook_answering(cluster)


def wait_webhook_answering(cluster: kc.LocalCluster) -> None:
    """Until the apiserver calls the webhook: a dry run only the webhook refuses."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvbridge_testkit.sim import wait_until

    custom = client.CustomObjectsApi(cluster.api_client())
    probe = {"apiVersion": "kvbridge.io/v1alpha1", "kind": "KVTransfer",
             "metadata": {"name": "webhook-probe"},
             "spec": {"protocolVersion": 10, "mode": "pull",
                      "prefill": {"tensorParallelSize": 1},
                      "decode": {"tensorParallelSize": 1}}}

    def answering() -> bool:
        try:
            custom.create_namespaced_custom_object("kvbridge.io", "v1alpha1", NS,
                                                   "kvtransfers", probe, dry_run="All")
        except ApiException as exc:
            return exc.status == 422 and "spec.protocolVersion" in exc.body
        return False

    wait_until(answering, timeout=60, interval=0.5, what="the apiserver to call the webhook")


def show_admission(cluster: kc.LocalCluster, custom: object, sa: str) -> None:
    """As decode-0 (its pod-bound token): a malformed KVEndpoint, then an attempt to redirect
    prefill-0's side channel; the webhook refuses both with a message."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvbridge_testkit.sim import pod_bound_token

    token = pod_bound_token(cluster.kubectl, NS, sa, "decode-0", seconds=600)
    as_decode = client.CustomObjectsApi(
        cluster.api_client(cluster.kubeconfig_for_token(token, "demo-decode-0")))
    own = custom.get_namespaced_custom_object(  # type: ignore[attr-defined]
        "kvbridge.io", "v1alpha1", NS, "kvendpoints", "decode-0")
    bad = {"apiVersion": "kvbridge.io/v1alpha1", "kind": "KVEndpoint",
           "metadata": {"name": "decode-0-rank2",
                        "ownerReferences": own["metadata"]["ownerReferences"]},
           "spec": {**own["spec"], "tpRank": 2, "tpSize": 1}}
    attempts = [
        ("decode-0 publishes a KVEndpoint with tpRank 2 of tpSize 1",
         lambda: as_decode.create_namespaced_custom_object(
             "kvbridge.io", "v1alpha1", NS, "kvendpoints", bad)),
        ("decode-0 rewrites prefill-0's side-channel address to 10.9.9.9",
         lambda: as_decode.patch_namespaced_custom_object(
             "kvbridge.io", "v1alpha1", NS, "kvendpoints", "prefill-0",
             {"spec": {"sideChannel": {"host": "10.9.9.9", "port": 5600}}})),
    ]
    for what, call in attempts:
        try:
            call()
        except ApiException as exc:
            message = str(json.loads(exc.body).get("message", exc.reason))
            head, sep, problems = message.partition("denied the request: ")
            by = head.strip() if sep else "the apiserver"
            say(f"admission: {what}: refused (HTTP {exc.status}) by {by}:")
            # The webhook joins its problems with "; ", each starting with a field path.
            for problem in re.split(r"; (?=(?:metadata|spec)\.)", problems or message):
                print(f"           - {problem[:220]}", flush=True)
        else:
            raise SystemExit(f"admission: {what}: was ADMITTED; the webhook is not working")


if __name__ == "__main__":
    sys.exit(main())
