"""examples/serving/ on the real node with the chart's router in front, for the modules that
put it under routed load: the rollouts (test_serving_rollouts.py) and the soak
(soak_serving.py, run by bench/bench_soak.py). A revision is a seed of
``kvbridge write-test-model``: new weights under the same model name and path."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from chartlib import CHART, Kube
from kubernetes import client
from nodelib import AGENT_NS, OPERATOR_NS, RELEASE

from kvbridge_agent.resources import revision_label
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.node_pods import image_values
from kvbridge_testkit.openai_load import LoadRecord

NS, T = AGENT_NS, vp.TRANSFER
MAX_TOKENS = 8
PROMPTS = vp.prompts(4, seed=35)
PODS = f"app.kubernetes.io/name={T}"
#: the test model's seed per revision (examples/serving/ as written is A)
SEEDS = {"A": "9", "B": "10", "C": "11"}
ROLLOUT_S = 900
ROUTER_PODS = f"app.kubernetes.io/component=router,app.kubernetes.io/instance={RELEASE}"


@dataclass
class Stack:
    docs: dict[str, dict[str, Any]]
    router: str
    #: revision label -> prompt -> the single-engine answer of that revision
    references: dict[str, dict[str, str]]


def at_revision(doc: dict[str, Any], revision: str, image: str = "") -> dict[str, Any]:
    """The Deployment ``doc`` serving revision ``revision`` (its test-model seed), with the
    vLLM container's image ``image`` when given."""
    out = copy.deepcopy(doc)
    spec = out["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"][-2] == "--seed", init["command"]
    init["command"][-1] = SEEDS[revision]
    if image:
        spec["containers"][0]["image"] = image
    return out


def apply(kube: Kube, doc: dict[str, Any]) -> None:
    kube.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))


def rolled_out(api: Api, role: str) -> None:
    """Wait as ``kubectl rollout status`` does: every replica updated and available, no old
    one left."""
    apps = client.AppsV1Api(api.core.api_client)

    def done() -> bool:
        d = apps.read_namespaced_deployment(f"{T}-{role}", NS)
        s = d.status
        return (s.observed_generation or 0) >= d.metadata.generation and \
            s.updated_replicas == s.replicas == s.available_replicas == d.spec.replicas
    wait_for(done, timeout=ROLLOUT_S, interval=2, what=f"the {role} Deployment rolled out")


def revisions_of(api: Api, role: str) -> set[str]:
    """The revision labels the live ``role`` endpoints publish."""
    return {revision_label(e["spec"].get("model", {}).get("revision", ""),
                           e["spec"].get("model", {}).get("fingerprint", ""))
            for e in api.endpoints(NS).values()
            if e["spec"]["transferName"] == T and e["spec"]["role"] == role
            and not e["metadata"].get("deletionTimestamp")}


def references_of(api: Api, revision: str) -> dict[str, str]:
    """Each prompt's greedy answer from one prefill engine of ``revision`` computing it alone."""
    (pod,) = [e["spec"]["podName"] for e in api.endpoints(NS).values()
              if e["spec"]["transferName"] == T and e["spec"]["role"] == "prefill"
              and revision_label(e["spec"]["model"].get("revision", ""),
                                 e["spec"]["model"]["fingerprint"]) == revision]
    ip = api.core.read_namespaced_pod(pod, NS).status.pod_ip
    return {p: vp.complete(ip, p, MAX_TOKENS)["choices"][0]["text"] for p in PROMPTS}


def health(router: str) -> dict[str, Any]:
    try:
        return vp.get_json(f"{router}/health")
    except Exception as exc:  # 503 while no pair is verified
        return {"status": "unavailable", "error": str(exc)}


def summary(load: LoadRecord, start: float, end: float) -> str:
    failed: dict[str, int] = {}
    for o in load.failed:
        failed[o.error[:120]] = failed.get(o.error[:120], 0) + 1
    return (f"{len(load.answered)} answered {load.per_revision()}, {len(load.failed)} failed "
            f"{failed}, longest time without an answer {load.longest_gap(start, end):.1f} s")


@contextlib.contextmanager
def serving_stack(api: Api, kube: Kube, images: dict[str, str],
                  docs: dict[str, dict[str, Any]] | None = None) -> Iterator[Stack]:
    """examples/serving/ at revision A (or ``docs``, those manifests edited) with the chart's
    router in front (two replicas), both pairs verified; everything it added is removed when
    the block ends."""
    docs = docs or vp.manifests(images["KVB_IMAGE_VLLM"], images["KVB_IMAGE_OPERATOR"])
    for stem in ("kvtransfer", "prefill", "decode"):
        apply(kube, docs[stem])
    kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
              "--set", "router.enabled=true", "--set", f"router.transfer={T}",
              "--set", f"router.namespace={NS}", timeout=240)  # fmt: skip
    try:
        wait_for(lambda: vp.serving_pods(api.core, NS), timeout=420, interval=2,
                 what="one prefill and two decode vLLM pods Ready")  # fmt: skip
        service = api.core.read_namespaced_service(f"{RELEASE}-router", NS)
        router = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
        wait_for(lambda: health(router).get("verifiedPairs") == 2, timeout=240, interval=1,
                 what="the router with both pairs verified")
        (revision,) = revisions_of(api, "decode")
        yield Stack(docs, router, {revision: references_of(api, revision)})
    finally:
        for kind, name in (("deployment", f"{T}-prefill"), ("deployment", f"{T}-decode"),
                           ("kvtransfer", T)):  # fmt: skip
            kube.kubectl("delete", kind, name, "-n", NS, "--ignore-not-found", "--wait=false")
        kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
                  *image_values(images["KVB_IMAGE_OPERATOR"]), "--set", "router.enabled=false",
                  timeout=240)  # fmt: skip
        wait_for(lambda: not api.core.list_namespaced_pod(
            NS, label_selector=f"app.kubernetes.io/name={T}").items, timeout=180, interval=1,
            what="the vLLM pods gone")  # fmt: skip


