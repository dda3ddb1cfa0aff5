"""vLLM serving pods on a real node (kvbridge_testkit.node): the manifests of
examples/serving/ as a node here runs them, and the P/D request flow vLLM documents, sent to
the pods' OpenAI HTTP ports. Used by ``make demo``, tests/node/test_serving_vllm.py and
tests/e2e/test_router_engines.py.

The example files are applied as written except for the image, which on this machine is the
locally built ``localhost/kvbridge-vllm:dev``: nothing else may differ, so the examples cannot
rot unnoticed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvbridge_testkit import REPO

SERVING = REPO / "examples" / "serving"
TRANSFER = "tiny-llama"
MODEL = "tiny-llama"
HTTP_PORT = 8000
#: A decode's vLLM (decode.yaml): its 8000 is the gateway's P/D sidecar.
DECODE_HTTP_PORT = 8200
METRICS_PORT = 9400
#: The images the example files name; a node here runs the local builds under other names.
EXAMPLE_IMAGE = "kvbridge-vllm-cpu:0.1.0"
EXAMPLE_OPERATOR_IMAGE = "ghcr.io/kvbridge/kvbridge-operator:0.1.0"
#: Words that the test model's byte-level tokenizer splits into different tokens.
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray")


def manifests(image: str, operator_image: str) -> dict[str, dict[str, Any]]:
    """examples/serving/*.yaml by file stem, every container's image set to ``image`` (the
    vLLM image) or ``operator_image`` (the decodes' P/D sidecar)."""
    local = {EXAMPLE_IMAGE: image, EXAMPLE_OPERATOR_IMAGE: operator_image}
    out = {}
    for path in sorted(SERVING.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        for container in _containers(doc):
            if container["image"] not in local:
                raise ValueError(f"{path}: container {container['name']} runs "
                                 f"{container['image']!r}, expected one of {sorted(local)}")
            container["image"] = local[container["image"]]
            container["imagePullPolicy"] = "Never"
        out[path.stem] = doc
    return out


def _containers(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc.get("spec")
    if doc["kind"] in ("Deployment", "Pod"):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def incompatible_decode(decode: dict[str, Any], name: str, dtype: str = "bfloat16"
                        ) -> dict[str, Any]:  # fmt: skip
    """A bare decode Pod from the decode Deployment's template whose KV cache has another
    dtype: the operator must refuse it before it gets any request. (A different block size
    would not do: vLLM 0.30.0 pairs engines of different block sizes, and so does kvbridge.)
    Not adopted by the Deployment's ReplicaSet, whose selector adds pod-template-hash."""
    template = copy.deepcopy(decode["spec"]["template"])
    container = template["spec"]["containers"][0]
    container["command"] = [f"--dtype={dtype}" if a.startswith("--dtype=") else a
                            for a in container["command"]]  # fmt: skip
    labels = {**template["metadata"]["labels"], "kvbridge.io/variant": f"kv-{dtype}"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels}, "spec": template["spec"]}


def pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def role_pods(core: Any, ns: str, role: str) -> list[Any]:
    """The example Deployments' ``role`` pods in ``ns`` (CoreV1Api ``core``), by name: pods
    being deleted and variants (:func:`incompatible_decode`) left out."""
    selector = f"app.kubernetes.io/name={TRANSFER},kvbridge.io/role={role}"
    return sorted((p for p in core.list_namespaced_pod(ns, label_selector=selector).items
                   if p.metadata.deletion_timestamp is None
                   and "kvbridge.io/variant" not in (p.metadata.labels or {})),
                  key=lambda p: p.metadata.name)  # fmt: skip


def pod_report(core: Any, ns: str) -> str:
    """Each pod of ``ns`` with its phase and every container's state: why a pod is not Ready."""
    lines = []
    for pod in core.list_namespaced_pod(ns).items:
        lines.append(f"  {pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase} "
                     f"{[(c.type, c.status, c.reason) for c in pod.status.conditions or []]}")
        for c in pod.status.container_statuses or []:
            state = c.state.waiting or c.state.terminated or c.state.running
            lines.append(f"    {c.name}: ready={c.ready} restarts={c.restart_count} {state}")
    return "\n".join(lines)


def serving_pods(core: Any, ns: str) -> dict[str, list[Any]] | None:
    """The examples' one prefill and two decode pods by role, once all are Ready; None until
    then (a poll for a fresh apply, or for a deleted pod's replacement)."""
    pods = {role: role_pods(core, ns, role) for role in ("prefill", "decode")}
    counts_ok = len(pods["prefill"]) == 1 and len(pods["decode"]) == 2
    return pods if counts_ok and all(pod_ready(p) for ps in pods.values() for p in ps) else None


def prompts(count: int, seed: int, words: int = 40) -> list[str]:
    """Seeded prompts of random words (different contexts, so a wrong KV shows)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words + 7 * i)) for i in range(count)]


class EngineError(RuntimeError):
    """A vLLM pod answered an error or could not be reached; the message has its reply."""


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST JSON, return the JSON answer; EngineError (with the reply) on any failure."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        raise EngineError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    except OSError as exc:
        raise EngineError(f"{url}: {exc}") from exc


def completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion request whose answer carries the generated token ids
    (``choices[0]["token_ids"]``)."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def complete(ip: str, prompt: str, max_tokens: int, port: int = HTTP_PORT,
             **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A greedy completion from the engine at pod IP ``ip`` (a decode's: DECODE_HTTP_PORT)."""
    return post(f"http://{ip}:{port}/v1/completions",
                completion(prompt, max_tokens, **extra))  # fmt: skip


@dataclass(frozen=True)
class PDResult:
    token_ids: list[int]
    text: str
    #: what the prefill returned and the decode received
    kv_transfer_params: dict[str, Any]
    prompt_tokens: int


def pd_complete(prefill_ip: str, decode_ip: str, prompt: str, max_tokens: int) -> PDResult:
    """vLLM's P/D flow: the prefill computes the prompt for one token with
    ``do_remote_decode``; its ``kv_transfer_params`` (``do_remote_prefill`` set) make the
    decode request, which pulls the prompt's KV from the prefill instead of computing it."""
    first = complete(prefill_ip, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    if not params or not params.get("do_remote_prefill"):
        raise EngineError(f"prefill {prefill_ip} returned no kv_transfer_params: {first}")
    answer = complete(decode_ip, prompt, max_tokens, DECODE_HTTP_PORT, kv_transfer_params=params)
    choice = answer["choices"][0]
    return PDResult(choice["token_ids"], choice["text"], params,
                    answer["usage"]["prompt_tokens"])


def post_with_header(url: str, body: dict[str, Any], header: str
                     ) -> tuple[list[int], str] | None:  # fmt: skip
    """The greedy token ids of a completion and the answer's ``header``; None on an error
    answer or none at all (for a poll loop)."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.load(reply)["choices"][0]["token_ids"], reply.headers.get(header, "")
    except OSError:
        return None


def scrape(ip: str, port: int) -> dict[str, float]:
    """Prometheus text metrics as {'name{labels}': value} (comments left out)."""
    return scrape_url(f"http://{ip}:{port}/metrics")


def scrape_url(url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """The sum of every series of ``name`` (any labels)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


@dataclass(frozen=True)
class PullCounters:
    """What a decode pod says it pulled: vLLM's count of prompt tokens loaded by its KV
    connector, and kvbridge's agent counters."""

    external_hit_tokens: float
    transfer_bytes: float
    transfer_failures: float

    @classmethod
    def of(cls, ip: str) -> PullCounters:
        vllm, agent = scrape(ip, DECODE_HTTP_PORT), scrape(ip, METRICS_PORT)
        return cls(metric_sum(vllm, "vllm:external_prefix_cache_hits_total"),
                   metric_sum(agent, "kvbridge_agent_transfer_bytes_total"),
                   metric_sum(agent, "kvbridge_agent_transfer_failures_total"))


# -- through the router (kvbridge-router) ---------------------------------------------------
def get_json(url: str, timeout: float = 10.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"null")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def routed_complete(router: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy completion sent to the router, which picks the pair."""
    return post(f"{router}/v1/completions", completion(prompt, max_tokens))


def router_series(router: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The router's series of ``name``: (labels, value) pairs."""
    out = []
    for key, value in scrape_url(f"{router}/metrics").items():
        if key.startswith(name + "{"):
            pairs = (part.split("=", 1) for part in key[len(name) + 1:-1].split('",')
                     if "=" in part)  # fmt: skip
            out.append(({k: v.strip('"') for k, v in pairs}, value))
    return out


@dataclass
class RoutedLoad:
    """What :func:`routed_load`'s clients got, in order: (prompt, token ids) per answer and
    (prompt, EngineError) per failed request, so wrong tokens and failures are told apart."""

    results: list[tuple[str, list[int] | EngineError]] = field(default_factory=list)

    @property
    def answered(self) -> list[tuple[str, list[int]]]:
        return [(p, t) for p, t in self.results if not isinstance(t, EngineError)]

    @property
    def failed(self) -> list[EngineError]:
        return [t for _, t in self.results if isinstance(t, EngineError)]


@contextlib.contextmanager
def routed_load(router: str, prompts: Sequence[str], max_tokens: int, clients: int = 4
                ) -> Iterator[RoutedLoad]:  # fmt: skip
    """``clients`` threads sending greedy completions of ``prompts`` (each client starting at
    its own) to the router back to back while the block runs: steady load under which a test
    removes a decode. Leaving the block stops and joins them; a client's unexpected error is
    raised there."""
    load, stop, prompts = RoutedLoad(), threading.Event(), list(prompts)

    def client(offset: int) -> None:
        while not stop.is_set():
            prompt = prompts[offset % len(prompts)]
            offset += 1
            try:
                answer = routed_complete(router, prompt, max_tokens)
                load.results.append((prompt, answer["choices"][0]["token_ids"]))
            except EngineError as exc:
                load.results.append((prompt, exc))

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        try:
            yield load
        finally:
            stop.set()   # also when the block fails: the clients never outlive it
        for f in futures:
            f.result()


def check_openai_client(router: str, prompt: str, reference: list[int], max_tokens: int
                        ) -> None:  # fmt: skip
    """The official ``openai`` client through the router: the model list, a completion
    equal to ``reference`` (greedy token ids), the same completion streamed, and a chat
    answer whole and streamed. Raises AssertionError on the first difference."""
    import openai

    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list().data]
    assert models == [MODEL], models
    extra = {"ignore_eos": True, "return_token_ids": True}
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body=extra)
    got = done.choices[0].token_ids  # type: ignore[attr-defined]
    assert got == reference, (got, reference)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body=extra)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == done.choices[0].text, (streamed, done.choices[0].text)
    chat = [{"role": "user", "content": prompt}]
    answer = client.chat.completions.create(model=MODEL, messages=chat, temperature=0,
                                            max_tokens=max_tokens, extra_body=extra)
    pieces = client.chat.completions.create(model=MODEL, messages=chat, temperature=0,
                                            max_tokens=max_tokens, stream=True,
                                            extra_body=extra)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert answer.choices[0].message.content == text, (answer.choices[0].message.content, text)
    assert answer.usage is not None and answer.usage.completion_tokens == max_tokens, answer.usage
