"""The P/D router, and the inference-gateway path, in front of real vLLM engines as
processes, on the local control plane.

Four ``vllm serve`` processes with KVBridgeConnector stand in for pods (their Pod objects on
the fake nodes give them identities, ownerReferences and pod-bound tokens): one prefill, two
decodes and a third decode in bfloat16, which the operator refuses. ``kvbridge-router`` runs
as a process with a ServiceAccount that may only read KVTransfers and KVEndpoints, and
follows what the operator and the decodes' handshakes report. Checked here: greedy tokens
equal one engine's under concurrency, the refused decode never receives a request, the
official openai client, the abort path (a client that leaves while its decode waits gets
the prefill's blocks freed at once, not after the lease), and a decode killed under load
(no wrong tokens, the failed attempts retried on the other pair).

The gateway path shares the engines: a real Envoy configured as the inference extension
configures a pool's gateway, ``kvbridge-router epp`` as its endpoint picker and
``kvbridge-router sidecar`` in front of each decode, all following the same KVTransfer. Each
engine has a loopback address of its own (127.0.0.x, as a pod has an IP), so the pool's one
target port (the sidecars') names a decode by address. Checked there: the openai client
through Envoy, both verified pairs serving and the refused decode none, a forged prefill
header refused by the sidecar, the picker killed (FailClose: errors, never a wrong answer)
and back, and the decode kill under load through both fronts at once.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai_surface
import pytest

from kvbridge_operator.config import TRANSFERS
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.envoy import Envoy
from kvbridge_testkit.sim import SimPod, create_agent_rbac, pod_bound_token
from kvbridge_testkit.vllm_harness import vllm_python
from kvbridge_testkit.vllm_servers import OpenAIServer, connector_config, start_servers

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.timeout(900)]  # fmt: skip
log = logging.getLogger(__name__)

AGENT_SA, ROUTER_SA = "kvbridge-agent", "kvbridge-router"
MAX_TOKENS = 8
#: The prefill's kv_lease_duration: long, so that blocks freed early are told from blocks
#: that expired. The router is told the same.
LEASE_S = 120
ROUTER_RULES = [{"apiGroups": ["kvbridge.io"], "resources": ["kvtransfers", "kvendpoints"],
                 "verbs": ["get", "list", "watch"]}]  # fmt: skip


@dataclass
class Serving:
    ns: str
    engines: dict[str, OpenAIServer]
    pods: dict[str, SimPod]
    router: str
    router_proc: subprocess.Popen[bytes]
    references: dict[str, list[int]]
    #: the router's ServiceAccount (read-only on KVTransfers and KVEndpoints), and a folder
    kubeconfig: Path
    work: Path

    def engine_id(self, name: str) -> str:
        return f"{self.ns}-{name}"


def router_rbac(api: Api, ns: str) -> None:
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(api.core.api_client)
    api.core.create_namespaced_service_account(ns, {"metadata": {"name": ROUTER_SA}})
    rbac.create_namespaced_role(ns, {"metadata": {"name": ROUTER_SA}, "rules": ROUTER_RULES})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": ROUTER_SA},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER_SA},
        "subjects": [{"kind": "ServiceAccount", "name": ROUTER_SA, "namespace": ns}]})


@pytest.fixture(scope="module")
def serving(cluster: Any, api: Api, operator: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Serving]:  # fmt: skip
    try:
        vllm_python()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    work = tmp_path_factory.mktemp("router-engines")
    ns = f"router-engines-{uuid.uuid4().hex[:5]}"
    api.core.create_namespace({"metadata": {"name": ns}})
    create_agent_rbac(cluster.api_client(), ns, AGENT_SA)
    router_rbac(api, ns)
    api.create_transfer(ns)
    from kvbridge_agent._testmodel import write_test_model

    model = write_test_model(work / "model", seed=9)
    # name: (role, dtype, extra_config); decodes take one request at a time, so that a
    # request can be made to wait at a busy decode (the abort test).
    layout = {"prefill-0": ("prefill", "float32", {"kv_lease_duration": LEASE_S}),
              "decode-0": ("decode", "float32", {}), "decode-1": ("decode", "float32", {}),
              "decode-bf16": ("decode", "bfloat16", {})}  # fmt: skip
    engines: dict[str, OpenAIServer] = {}
    pods: dict[str, SimPod] = {}
    router_proc = None
    try:
        for index, (name, (role, dtype, extra)) in enumerate(layout.items()):
            host = f"127.0.0.{11 + index}"
            pod = SimPod(cluster, ns, name, role=role, engine_id=f"{ns}-{name}",
                         sa=AGENT_SA).create_pod()
            token = pod_bound_token(cluster.kubectl, ns, AGENT_SA, pod.name)
            pods[name] = pod
            engines[name] = OpenAIServer(
                model, work, name, dtype=dtype, max_num_seqs=None if role == "prefill" else 1,
                connector=connector_config(engine_id=pod.engine_id, **extra), host=host,
                env={"POD_NAME": pod.name, "POD_UID": pod.uid, "POD_NAMESPACE": ns,
                     "NODE_NAME": pod.node, "POD_IP": host,
                     "KUBECONFIG": str(cluster.kubeconfig_for_token(token, f"{ns}-{name}")),
                     "KVBRIDGE_POD_LABELS_FILE": str(work / "no-labels"),
                     "KVBRIDGE_TRANSFER": "kvt", "KVBRIDGE_ROLE": role,
                     "KVBRIDGE_SYNC_INTERVAL_S": "0.5"},
                extra_args=["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": f"tcp://*:{free_port()}"})])  # fmt: skip
        started = time.monotonic()
        start_servers(*engines.values())
        log.info("four vllm serve processes up in %.0f s", time.monotonic() - started)

        token = cluster.kubectl("create", "token", ROUTER_SA, "-n", ns).stdout.strip()
        router_kubeconfig = cluster.kubeconfig_for_token(token, f"{ns}-router")
        port = free_port()
        router_log = (work / "router.log").open("wb")
        router_proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_router", "--transfer", "kvt", "--namespace", ns,
             "--host", "127.0.0.1", "--port", str(port), "--lease-seconds", str(LEASE_S),
             "--kubeconfig", str(router_kubeconfig)],
            stdout=router_log, stderr=subprocess.STDOUT)  # fmt: skip
        router = f"http://127.0.0.1:{port}"

        def router_up() -> bool:
            if router_proc is not None and router_proc.poll() is not None:
                raise AssertionError(f"kvbridge-router exited: {(work / 'router.log').read_text()}")
            return vp.http_ok(f"{router}/metrics")

        wait_for(router_up, timeout=60, what="kvbridge-router serving")
        # Reference tokens: the prefill computing each prompt alone.
        references = {p: vp.post(f"{engines['prefill-0'].url}/v1/completions",
                                 vp.completion(p, MAX_TOKENS))["choices"][0]["token_ids"]
                      for p in vp.prompts(4, seed=31)}  # fmt: skip
        yield Serving(ns, engines, pods, router, router_proc, references,
                      Path(router_kubeconfig), work)
    finally:
        if router_proc is not None:
            router_proc.terminate()
            router_proc.wait(30)
        for e in engines.values():
            e.stop()
        for t in api.list(TRANSFERS, ns):
            api.delete(TRANSFERS, ns, t["metadata"]["name"])
        wait_for(lambda: not api.list(TRANSFERS, ns), timeout=30, what="KVTransfers deleted")
        api.core.delete_namespace(ns)


def answered_by_decode(s: Serving) -> dict[str, float]:
    """The router's answered requests per decode engine id."""
    return {labels["decode"]: n for labels, n in vp.router_series(
        s.router, "kvbridge_router_requests_total")
        if labels["outcome"] == "answered" and labels["decode"]}  # fmt: skip


def retried(s: Serving) -> float:
    return sum(n for _, n in vp.router_series(s.router, "kvbridge_router_retries_total"))


def test_concurrent_requests_take_verified_pairs_only(api: Api, serving: Serving) -> None:
    s = serving
    wait_for(lambda: (api.endpoint(s.ns, "decode-bf16").get("status") or {}).get("state")
             == "Incompatible", timeout=120, what="the bfloat16 decode refused")  # fmt: skip
    status = api.endpoint(s.ns, "decode-bf16")["status"]
    assert status["message"].startswith("spec.compatibilityHash: incompatible"), status
    health = wait_for(lambda: (lambda h: h if h.get("verifiedPairs") == 2 else None)(
        vp.get_json(f"{s.router}/health")), timeout=120, what="two verified pairs")
    assert health == {"status": "ok", "verifiedPairs": 2}
    # Engines are reached at the port their KVEndpoint states, not one port for all.
    assert api.endpoint(s.ns, "decode-0")["spec"]["servingPort"] == s.engines["decode-0"].port

    jobs = [prompt for prompt in s.references for _ in range(4)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(
            lambda p: vp.post(f"{s.router}/v1/completions", vp.completion(p, MAX_TOKENS)), jobs))
    assert [a["choices"][0]["token_ids"] for a in answers] == [s.references[p] for p in jobs]
    served = answered_by_decode(s)
    assert set(served) == {s.engine_id("decode-0"), s.engine_id("decode-1")}, served
    assert sum(served.values()) == len(jobs)
    # The refused decode saw no request at all, and the prompts were pulled, not recomputed.
    bad = vp.scrape_url(f"{s.engines['decode-bf16'].url}/metrics")
    assert vp.metric_sum(bad, "vllm:request_success_total") == 0
    for name in ("decode-0", "decode-1"):
        metrics = vp.scrape_url(f"{s.engines[name].url}/metrics")
        assert vp.metric_sum(metrics, "vllm:external_prefix_cache_hits_total") > 0, name


def test_openai_client_through_the_router(serving: Serving) -> None:
    prompt, reference = next(iter(serving.references.items()))
    vp.check_openai_client(serving.router, prompt, reference, MAX_TOKENS)


def kv_usage(server: OpenAIServer) -> float:
    return vp.metric_sum(vp.scrape_url(f"{server.url}/metrics"), "vllm:kv_cache_usage_perc")


def test_a_client_leaving_before_its_decode_read_frees_the_prefills_blocks(
        serving: Serving) -> None:
    """Both decodes busy with long requests (one request at a time each), a routed request
    waits at one of them after its prefill; the client leaves. The decode aborts it and
    tells the prefill, which frees the prompt's blocks while the decodes are still busy,
    far inside its lease. A prefill answer no decode ever asks for stays held: the usage
    gauge shows held blocks."""
    s = serving
    prefill = s.engines["prefill-0"]
    unread = vp.prompts(1, seed=41)[0]   # prefilled for a remote decode that never comes
    vp.post(f"{prefill.url}/v1/completions",
            vp.completion(unread, 1, kv_transfer_params={"do_remote_decode": True}))
    held = wait_for(lambda: kv_usage(prefill) or None, timeout=10, what="held blocks shown")
    successes = {n: vp.metric_sum(vp.scrape_url(f"{s.engines[n].url}/metrics"),
                                  "vllm:request_success_total")
                 for n in ("decode-0", "decode-1")}  # fmt: skip
    # ~950 tokens each: several seconds of decoding on both decodes.
    with ThreadPoolExecutor(2) as pool:
        blockers = [pool.submit(vp.post, f"{s.engines[n].url}/v1/completions",
                                vp.completion("alpha bravo", 950), 300.0)
                    for n in ("decode-0", "decode-1")]  # fmt: skip
        wait_for(lambda: all(vp.metric_sum(vp.scrape_url(f"{s.engines[n].url}/metrics"),
                                           "vllm:num_requests_running") == 1
                             for n in ("decode-0", "decode-1")), timeout=30,
                 what="both decodes busy")  # fmt: skip
        body = json.dumps(vp.completion(vp.prompts(1, seed=42)[0], 20, stream=True)).encode()
        port = int(s.router.rsplit(":", 1)[1])
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                       b"Content-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        waiting = wait_for(lambda: (lambda u: u if u > held else None)(kv_usage(prefill)),
                           timeout=30, what="the routed prompt prefilled and held")
        client.close()
        freed_at = wait_for(lambda: kv_usage(prefill) <= held and time.monotonic(),
                            timeout=30, interval=0.2, what="the prefill freeing the blocks")
        still_busy = not all(b.done() for b in blockers)
        for b in blockers:
            assert len(b.result()["choices"][0]["token_ids"]) == 950
    log.info("abort path: prefill KV usage %.4f held, %.4f with the waiting request, back to "
             "%.4f after the client left (decodes still busy: %s)", held, waiting,
             kv_usage(prefill), still_busy)
    assert freed_at and still_busy, "freed only once a decode was free to read: not the abort"
    # The aborted request never ran on a decode; the unread answer is still held.
    for n, before in successes.items():
        after = vp.metric_sum(vp.scrape_url(f"{s.engines[n].url}/metrics"),
                              "vllm:request_success_total")  # fmt: skip
        assert after == before + 1, (n, before, after)
    assert kv_usage(prefill) == held


def requests_counted(url: str) -> float:
    return sum(n for _, n in vp.router_series(url, "kvbridge_router_requests_total"))


@pytest.mark.parametrize("case", openai_surface.CASES, ids=lambda c: c.name)
def test_the_routers_openai_surface_is_the_engines(serving: Serving,
                                                   case: openai_surface.Case) -> None:
    """Each request shape and client error gets from the router what one engine answers
    (status, body shape, greedy tokens), and the router counts it exactly once. After the
    abort test, which measures the prefill's held blocks: a case the decode refuses leaves
    the prompt's blocks held on the prefill until its lease ends."""
    before = requests_counted(serving.router)
    openai_surface.compare(serving.router, serving.engines["decode-0"].url, case)
    assert requests_counted(serving.router) == before + 1


# -- the inference-gateway path: Envoy, the endpoint picker, a sidecar per decode ----------
GATEWAY_DECODES = ("decode-0", "decode-1", "decode-bf16")


@dataclass
class Gateway:
    s: Serving
    envoy: Envoy
    sidecar_port: int
    picker_port: int
    metrics_port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.envoy.url

    @property
    def picker_metrics(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def sidecar_url(self, decode: str) -> str:
        return f"http://{self.s.engines[decode].host}:{self.sidecar_port}"

    def spawn(self, name: str, *argv: str) -> None:
        """``kvbridge-router ARGV`` as the router's ServiceAccount, logging to a file."""
        log = (self.s.work / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_router", *argv, "--transfer", "kvt",
             "--namespace", self.s.ns, "--kubeconfig", str(self.s.kubeconfig)],
            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def start_picker(self) -> None:
        self.spawn("picker", "epp", "--host", "127.0.0.1", "--port", str(self.picker_port),
                   "--metrics-port", str(self.metrics_port),
                   "--target-port", str(self.sidecar_port))  # fmt: skip

        def up() -> bool:
            if self.procs["picker"].poll() is not None:
                raise AssertionError(f"the picker exited: {self.log('picker')}")
            return vp.http_ok(f"{self.picker_metrics}/metrics") and vp.get_json(
                f"{self.picker_metrics}/health").get("verifiedPairs") == 2
        wait_for(up, timeout=60, what="the endpoint picker seeing both verified pairs")

    def log(self, name: str) -> str:
        return (self.s.work / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(30)


@pytest.fixture(scope="module")
def gateway(serving: Serving) -> Iterator[Gateway]:
    s = serving
    gw = Gateway(s, Envoy(s.work, picker_port := free_port()), free_port(), picker_port,
                 free_port())
    try:
        for decode in GATEWAY_DECODES:
            engine = s.engines[decode]
            gw.spawn(f"sidecar-{decode}", "sidecar", "--host", engine.host,
                     "--port", str(gw.sidecar_port), "--pod-name", s.pods[decode].name,
                     "--decode-url", engine.url, "--lease-seconds", str(LEASE_S))
        gw.start_picker()
        for decode in GATEWAY_DECODES:
            wait_for(lambda d=decode: vp.http_ok(f"{gw.sidecar_url(d)}/metrics"), timeout=60,
                     what=f"the sidecar of {decode}")
        gw.envoy.start()
        yield gw
    finally:
        gw.envoy.stop()
        gw.stop()


def through_gateway(url: str, prompt: str, headers: dict[str, str] | None = None
                    ) -> tuple[list[int], str]:  # fmt: skip
    """The greedy token ids of one completion sent through ``url``, and the pair header."""
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(vp.completion(prompt, MAX_TOKENS)).encode(),
        {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["choices"][0]["token_ids"], reply.headers.get("x-kvbridge-pair")


def picked_by_decode(gw: Gateway) -> dict[str, float]:
    return {labels["decode"]: n for labels, n in vp.router_series(
        gw.picker_metrics, "kvbridge_picker_requests_total")
        if labels["outcome"] == "picked"}  # fmt: skip


def test_gateway_requests_take_verified_pairs_only(gateway: Gateway) -> None:
    gw, s = gateway, gateway.s
    bad_before = vp.metric_sum(vp.scrape_url(f"{s.engines['decode-bf16'].url}/metrics"),
                               "vllm:request_success_total")  # fmt: skip
    jobs = [prompt for prompt in s.references for _ in range(4)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: through_gateway(gw.url, p), jobs))
    assert [tokens for tokens, _ in answers] == [s.references[p] for p in jobs]
    pairs = {pair for _, pair in answers}
    good = {f"{s.engine_id('prefill-0')}->{s.engine_id(d)}" for d in ("decode-0", "decode-1")}
    assert pairs == good, pairs
    picked = picked_by_decode(gw)
    assert set(picked) == {s.engine_id("decode-0"), s.engine_id("decode-1")}, picked
    bad = vp.scrape_url(f"{s.engines['decode-bf16'].url}/metrics")
    assert vp.metric_sum(bad, "vllm:request_success_total") == bad_before == 0


def test_openai_client_through_the_gateway(gateway: Gateway) -> None:
    prompt, reference = next(iter(gateway.s.references.items()))
    vp.check_openai_client(gateway.url, prompt, reference, MAX_TOKENS)


def test_a_forged_prefill_header_is_refused_by_the_sidecar(gateway: Gateway) -> None:
    gw, s = gateway, gateway.s
    prefill = s.engines["prefill-0"]
    before = vp.metric_sum(vp.scrape_url(f"{prefill.url}/metrics"), "vllm:request_success_total")
    prompt = next(iter(s.references))
    for forged in (f"{s.engines['decode-1'].host}:{s.engines['decode-1'].port}",
                   "127.0.0.1:1"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            through_gateway(gw.sidecar_url("decode-0"), prompt,
                            {"x-prefiller-host-port": forged})
        assert refused.value.code == 403, refused.value.read()
    # Through Envoy the picker overwrites whatever the client sent: answered right.
    tokens, _ = through_gateway(gw.url, prompt, {"x-prefiller-host-port": "127.0.0.1:1",
                                                 "x-gateway-destination-endpoint":
                                                 f"{s.engines['decode-bf16'].host}:"
                                                 f"{gw.sidecar_port}"})  # fmt: skip
    assert tokens == s.references[prompt]
    after = vp.metric_sum(vp.scrape_url(f"{prefill.url}/metrics"), "vllm:request_success_total")
    assert after == before + 1


@pytest.mark.parametrize("case", openai_surface.CASES, ids=lambda c: c.name)
def test_the_gateways_openai_surface_is_the_engines(gateway: Gateway,
                                                    case: openai_surface.Case) -> None:
    """The same through Envoy, the picker and a decode's sidecar; the sidecar that served
    counts the request exactly once."""
    sidecars = [gateway.sidecar_url(d) for d in ("decode-0", "decode-1")]
    before = sum(requests_counted(url) for url in sidecars)
    openai_surface.compare(gateway.url, gateway.s.engines["decode-0"].url, case)
    assert sum(requests_counted(url) for url in sidecars) == before + 1


def test_the_picker_killed_fails_closed_and_recovers(gateway: Gateway) -> None:
    gw, s = gateway, gateway.s
    prompt = next(iter(s.references))
    gw.procs["picker"].kill()
    gw.procs["picker"].wait(10)
    for _ in range(3):
        with pytest.raises(urllib.error.HTTPError) as failed:
            through_gateway(gw.url, prompt)
        assert failed.value.code >= 500
    gw.start_picker()
    assert through_gateway(gw.url, prompt)[0] == s.references[prompt]


@pytest.fixture(scope="module")
def cache_router(serving: Serving) -> Iterator[str]:
    """A second router over the same engines, cache-aware with precise tracking: the
    engines' KV events (at the port each KVEndpoint states, which the connector read from
    vLLM's --kv-events-config) and their /tokenize."""
    s = serving
    port = free_port()
    log_path = s.work / "cache-router.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_router", "--transfer", "kvt", "--namespace", s.ns,
         "--host", "127.0.0.1", "--port", str(port), "--lease-seconds", str(LEASE_S),
         "--kubeconfig", str(s.kubeconfig), "--policy", "cache-aware", "--log-level", "DEBUG"],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the cache-aware router exited: {log_path.read_text()}")
        return vp.http_ok(f"{url}/health") and vp.get_json(f"{url}/health")["verifiedPairs"] == 2
    try:
        wait_for(up, timeout=60, what="the cache-aware router seeing both verified pairs")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def prompt_tokens(engine: OpenAIServer, source: str) -> float:
    """vLLM's prompt tokens of one source (local_compute, local_cache_hit,
    external_kv_transfer) so far."""
    metrics = vp.scrape_url(f"{engine.url}/metrics")
    return sum(v for k, v in metrics.items()
               if k.startswith("vllm:prompt_tokens_by_source_total{") and
               f'source="{source}"' in k)  # fmt: skip


def test_cache_aware_routing_follows_a_shared_prefix_and_pulls_only_new_blocks(
        api: Api, serving: Serving, cache_router: str) -> None:
    """Requests that share a long prefix, through the cache-aware router: after the first,
    each goes to the decode that holds the prefix (its KV events said so), that decode pulls
    only the blocks past the prefix, the prefill computes only them, and the tokens are the
    prefill's own for the whole prompt."""
    s, url = serving, cache_router
    prefill = s.engines["prefill-0"]
    assert api.endpoint(s.ns, "prefill-0")["spec"]["kvEventsPort"] == int(
        json.loads(prefill.argv[prefill.argv.index("--kv-events-config") + 1])["endpoint"]
        .rsplit(":", 1)[1])
    prefix = vp.prompts(1, seed=61, words=110)[0]
    tokens = vp.post(f"{prefill.url}/tokenize", {"model": vp.MODEL, "prompt": prefix})["tokens"]
    shared = (len(tokens) // 32 - 1) * 32          # full blocks surely shared (block size 32)
    assert shared >= 320, len(tokens)
    asked = [prefix + f" question {i}: " + q for i, q in enumerate(vp.prompts(4, 62, 6))]

    def event_blocks() -> float:
        return vp.metric_sum(vp.scrape_url(f"{url}/metrics"),
                             "kvbridge_router_kv_event_blocks_total")  # fmt: skip

    # The router follows all four engines' events (a subscriber sees what is published after
    # it joined): a throwaway request until its blocks show up there.
    wait_for(lambda: vp.metric_sum(vp.scrape_url(f"{url}/metrics"),
                                   "kvbridge_router_kv_event_engines") == 4,
             timeout=30, what="the router following four engines' KV events")  # fmt: skip
    for attempt in range(10):
        vp.post(f"{url}/v1/completions", vp.completion(f"warm-up {attempt} " * 20, 1))
        deadline = time.monotonic() + 5
        while not event_blocks() and time.monotonic() < deadline:
            time.sleep(0.2)
        if event_blocks():
            break
    assert event_blocks() > 0, "no KV event reached the router"
    decodes = ("decode-0", "decode-1")
    served: list[str] = []
    answers = []
    for i, prompt in enumerate(asked):
        stored = event_blocks()
        before = {n: {src: prompt_tokens(s.engines[n], src) for src in
                      ("local_compute", "local_cache_hit", "external_kv_transfer")}
                  for n in ("prefill-0", *decodes)}  # fmt: skip
        answered = {d: answered_by(url, s.engine_id(d)) for d in decodes}
        answers.append(vp.post(f"{url}/v1/completions", vp.completion(prompt, MAX_TOKENS)))
        decode = next(d for d in decodes if answered_by(url, s.engine_id(d)) > answered[d])
        served.append(decode)
        if i > 0:
            pulled = prompt_tokens(s.engines[decode], "external_kv_transfer") - \
                before[decode]["external_kv_transfer"]
            held = prompt_tokens(s.engines[decode], "local_cache_hit") - \
                before[decode]["local_cache_hit"]
            computed = prompt_tokens(prefill, "local_compute") - \
                before["prefill-0"]["local_compute"]
            length = len(vp.post(f"{prefill.url}/tokenize",
                                 {"model": vp.MODEL, "prompt": prompt})["tokens"])  # fmt: skip
            assert held >= shared, (i, held, shared)
            assert 0 < pulled <= length - shared, (i, pulled, length)
            assert computed <= length - shared, (i, computed, length)
        # The next choice sees this request's blocks: the decode's KV events arrived.
        wait_for(lambda b=stored: event_blocks() > b, timeout=30, interval=0.2,
                 what="the engines' KV events at the router")
    assert served[1:] == [served[0]] * 3, served
    references = [vp.post(f"{prefill.url}/v1/completions", vp.completion(p, MAX_TOKENS))
                  for p in asked]  # fmt: skip
    assert [a["choices"][0]["token_ids"] for a in answers] == \
        [r["choices"][0]["token_ids"] for r in references]
    hits = {labels["role"]: n for labels, n in vp.router_series(
        url, "kvbridge_router_pick_cache_hit_blocks_sum")}  # fmt: skip
    assert hits["decode"] >= 3 * shared // 32 and hits["prefill"] >= 3 * shared // 32, hits


def answered_by(router: str, decode_id: str) -> float:
    return sum(n for labels, n in vp.router_series(router, "kvbridge_router_requests_total")
               if labels["outcome"] == "answered" and labels["decode"] == decode_id)


def test_a_decode_killed_under_load_never_answers_wrong_tokens(api: Api,
                                                               gateway: Gateway) -> None:
    """decode-1's engine killed and its pod deleted (its sidecar goes with it) while clients
    send through the router and through the gateway. The router retries on the other pair
    and fails nothing; the gateway's requests already sent to decode-1 may fail (its pod is
    gone), none answers wrong tokens, and once the picker's table drops the pair all succeed."""
    s, gw = gateway.s, gateway
    retries_before = retried(s)
    with vp.routed_load(s.router, list(s.references), MAX_TOKENS) as load, \
            vp.routed_load(gw.url, list(s.references), MAX_TOKENS, clients=2) as gw_load:
        wait_for(lambda: len(load.results) >= 8 and len(gw_load.results) >= 4, timeout=120,
                 what="requests flowing through both fronts")
        s.engines["decode-1"].kill()
        gw.procs["sidecar-decode-1"].kill()
        s.pods["decode-1"].delete_pod()   # the pod gone: its KVEndpoint is collected
        wait_for(lambda: vp.get_json(f"{s.router}/health").get("verifiedPairs") == 1
                 and vp.get_json(f"{gw.picker_metrics}/health").get("verifiedPairs") == 1,
                 timeout=90, what="the router and the picker dropping the killed decode's pair")
        settled, gw_settled = len(load.results), len(gw_load.results)
        wait_for(lambda: len(load.results) >= settled + 8
                 and len(gw_load.results) >= gw_settled + 6, timeout=120,
                 what="requests after it")  # fmt: skip
    answered, failed = load.answered, load.failed
    log.info("decode-1 killed under load: router %d answered, %d failed, %d retried on another "
             "pair; gateway %d answered, %d failed", len(answered), len(failed),
             retried(s) - retries_before, len(gw_load.answered), len(gw_load.failed))
    assert [t for p, t in answered if t != s.references[p]] == []
    assert not failed, failed
    assert [t for p, t in gw_load.answered if t != s.references[p]] == []
    # Requests in flight when the table changed (at most one per client) may have failed.
    late = gw_load.results[gw_settled + 2:]
    assert [r for r in late if not isinstance(r[1], list)] == [], late
    assert "decode-1" not in api.endpoints(s.ns)
