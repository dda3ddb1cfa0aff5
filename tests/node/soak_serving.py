"""The soak of issue #37 (run by ``bench/bench_soak.py``, never by ``make test``: the file name
keeps it out of collection).

examples/serving/ (one prefill, two decodes) behind the chart's router (two replicas), with two
operator replicas electing a leader, under routed load from the ``openai`` client (streaming
and not) for ``KVB_SOAK_MINUTES``: a decode pod is deleted (``kubectl delete pod``, as a node
drain or a user does) every ``KVB_SOAK_DELETE_EVERY_S`` seconds, and the leading operator is
lost ``KVB_SOAK_LEADER_KILLS`` times (its process SIGKILLed and its pod force-deleted, as when
its node dies: no Lease release).

It records every request (answered, failed with its cause, wrong against the single-engine
reference), the hand-over time of each leader kill (until another replica holds the Lease),
how long each deleted decode took to be replaced and paired again (the new pod is created
while the operator may be changing hands), and the routers' and operators' resident memory at
start and end, and every KVEndpoint status the API server stored (a watch), and writes them
as JSON to ``KVB_SOAK_RESULTS``. It asserts that no answer is wrong and that no endpoint's
observed generation or epoch ever went backwards (a deposed leader's late write would).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from chartlib import CHART, Kube
from nodelib import OPERATOR_NS, RELEASE, container_pid, wait_rollout
from servinglib import MAX_TOKENS, NS, PODS, PROMPTS, ROUTER_PODS, Stack, health, serving_stack

from kvbridge_testkit import node as kn
from kvbridge_testkit import vllm_pods as vp
from kvbridge_testkit.e2e import Api, lease_holder, wait_for
from kvbridge_testkit.openai_load import openai_load
from kvbridge_testkit.soak_report import cause, schedule, unanswered_seconds, windows
from kvbridge_testkit.status_recorder import StatusRecorder, backwards

MINUTES = float(os.environ.get("KVB_SOAK_MINUTES", "30"))
DELETE_EVERY_S = float(os.environ.get("KVB_SOAK_DELETE_EVERY_S", "180"))
LEADER_KILLS = int(os.environ.get("KVB_SOAK_LEADER_KILLS", "2"))
WINDOW_S = float(os.environ.get("KVB_SOAK_WINDOW_S", "300"))
CLIENTS = int(os.environ.get("KVB_SOAK_CLIENTS", "4"))
RESULTS = os.environ.get("KVB_SOAK_RESULTS", "")
#: a client's pause after a failed request, as a client backing off would
PAUSE_AFTER_FAILURE_S = float(os.environ.get("KVB_SOAK_PAUSE_AFTER_FAILURE_S", "0.5"))
OPERATOR_PODS = f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={RELEASE}"

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.nixl, pytest.mark.vllm,
              pytest.mark.slow, pytest.mark.timeout(int(MINUTES * 60) + 1800)]  # fmt: skip
log = logging.getLogger(__name__)
for _noisy in ("httpx", "httpx2", "openai"):   # one line per request would bury the events
    logging.getLogger(_noisy).setLevel(logging.WARNING)


def rss_bytes(nodes: list[kn.RealNode], pod: Any) -> int:
    """Resident memory of a pod's first container's process, read through the host's /proc."""
    node = next(n for n in nodes if n.name == pod.spec.node_name)
    pid = container_pid(node, pod.status.container_statuses[0].container_id)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for pid {pid}")


def memory(api: Api, nodes: list[kn.RealNode]) -> dict[str, dict[str, Any]]:
    """Per router and operator pod: resident bytes and container restarts."""
    out = {}
    for ns, selector in ((NS, ROUTER_PODS), (OPERATOR_NS, OPERATOR_PODS)):
        for pod in api.core.list_namespaced_pod(ns, label_selector=selector).items:
            if pod.metadata.deletion_timestamp or not vp.pod_ready(pod):
                continue
            out[pod.metadata.name] = {"rss_bytes": rss_bytes(nodes, pod),
                                      "restarts": pod.status.container_statuses[0].restart_count}
    return out


def kill_leader(api: Api, kube: Kube, nodes: list[kn.RealNode]) -> dict[str, Any]:
    """The leading operator pod lost as with its node: its process SIGKILLed and the pod
    force-deleted at once, so the kubelet does not restart the container in place (a restarted
    container keeps the pod's name, its Lease identity, and simply renews). How long until
    another replica held the Lease (None if none did within 120 s)."""
    holder = lease_holder(api.core.api_client, OPERATOR_NS)
    pod = api.core.read_namespaced_pod(holder, OPERATOR_NS)
    node = next(n for n in nodes if n.name == pod.spec.node_name)
    os.kill(container_pid(node, pod.status.container_statuses[0].container_id), signal.SIGKILL)
    killed = time.monotonic()
    kube.kubectl("delete", "pod", holder, "-n", OPERATOR_NS, "--grace-period=0", "--force",
                 "--wait=false", check=False)  # fmt: skip
    try:
        new = wait_for(lambda: (lambda h: h if h and h != holder else None)(
            lease_holder(api.core.api_client, OPERATOR_NS)), timeout=120, interval=0.2,
            what="another operator replica leading")  # fmt: skip
    except AssertionError:
        return {"killed": holder, "leader": None, "handover_s": None}
    return {"killed": holder, "leader": new, "handover_s": round(time.monotonic() - killed, 2)}


def delete_decode(api: Api, kube: Kube, stack: Stack, until: float) -> dict[str, Any]:
    """Delete the oldest Ready decode pod (``kubectl delete pod``: it drains); how long until
    a replacement was Ready and both pairs were verified in the router again, measured until
    the monotonic time ``until`` (None if not by then)."""
    ready = [p for p in vp.role_pods(api.core, NS, "decode") if vp.pod_ready(p)]
    if not ready:
        return {"deleted": None, "skipped": "no Ready decode to delete"}
    victim = min(ready, key=lambda p: p.metadata.creation_timestamp).metadata.name
    kube.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
    deleted = time.monotonic()
    out: dict[str, Any] = {"deleted": victim, "replacement_ready_s": None, "repaired_s": None}
    while time.monotonic() < until and out["repaired_s"] is None:
        pods = vp.serving_pods(api.core, NS)
        if pods and victim not in {p.metadata.name for p in pods["decode"]}:
            out["replacement_ready_s"] = out["replacement_ready_s"] or round(
                time.monotonic() - deleted, 1)
            if health(stack.router).get("verifiedPairs") == 2:
                out["repaired_s"] = round(time.monotonic() - deleted, 1)
        time.sleep(1)
    return out


def restarts(api: Api) -> dict[str, int]:
    """Container restarts of the serving (vLLM) pods now present."""
    return {p.metadata.name: sum(c.restart_count for c in p.status.container_statuses or [])
            for p in api.core.list_namespaced_pod(NS, label_selector=PODS).items}


@pytest.fixture(scope="module")
def stack(api: Api, kube: Kube, release: str, images: dict[str, str]) -> Iterator[Stack]:
    kube.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values",
              "--set", "operator.replicas=2", timeout=240)  # fmt: skip
    wait_rollout(kube)
    with serving_stack(api, kube, images) as serving:
        yield serving


def test_soak(api: Api, kube: Kube, node_cluster: Any, stack: Stack) -> None:
    nodes = node_cluster[1]
    total_s = MINUTES * 60
    plan = schedule(total_s, DELETE_EVERY_S, LEADER_KILLS)
    memory_start = memory(api, nodes)
    events: list[dict[str, Any]] = []
    workers: list[threading.Thread] = []
    recorder = StatusRecorder(api.core.api_client, NS)
    recorder.start()
    with openai_load(stack.router, PROMPTS, MAX_TOKENS, clients=CLIENTS,
                     pause_after_failure_s=PAUSE_AFTER_FAILURE_S) as load:
        start = time.monotonic()
        for at, what in plan:
            time.sleep(max(0.0, start + at - time.monotonic()))
            event: dict[str, Any] = {"at_s": round(time.monotonic() - start, 1), "what": what}
            events.append(event)
            if what == "kill-leader":
                try:
                    event.update(kill_leader(api, kube, nodes))
                except Exception as exc:   # recorded; the soak goes on
                    event["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:   # measured in the background: the next event keeps its time
                def measure(event: dict[str, Any] = event) -> None:
                    event.update(delete_decode(api, kube, stack, start + total_s + 300))
                workers.append(threading.Thread(target=measure, daemon=True))
                workers[-1].start()
            log.info("soak event %s", event)
        time.sleep(max(0.0, start + total_s - time.monotonic()))
        end = time.monotonic()
    for worker in workers:   # the last replacements may still be coming up
        worker.join(timeout=max(1.0, start + total_s + 300 - time.monotonic()))
    recorder.stop()
    for kill in (e for e in events if e["what"] == "kill-leader"):
        # the decode deleted just before the kill: its replacement was created while the old
        # leader died and, published later, paired by the new one
        deletion = max((e for e in events if e["what"] == "delete-decode"
                        and e["at_s"] <= kill["at_s"]), key=lambda e: e["at_s"], default=None)
        if deletion is not None and deletion.get("repaired_s") is not None:
            kill["replacement_paired_after_handover_s"] = round(
                deletion["at_s"] + deletion["repaired_s"] - kill["at_s"] - kill["handover_s"], 1)
    memory_end = memory(api, nodes)
    rows = windows(load, start, end, WINDOW_S, stack.references)
    wrong = load.wrong(stack.references)
    failures = dict(Counter(cause(o) for o in load.failed))   # as windows() counts them
    results = {
        "minutes": MINUTES, "delete_every_s": DELETE_EVERY_S, "leader_kills": LEADER_KILLS,
        "clients": CLIENTS, "window_s": WINDOW_S,
        "answered": len(load.answered), "failed": len(load.failed), "wrong": len(wrong),
        "failures": failures, "events": events, "windows": [asdict(r) for r in rows],
        "memory_start": memory_start, "memory_end": memory_end,
        "longest_gap_s": round(load.longest_gap(start, end), 1),
        "status_backwards": backwards(recorder.seen),
        "serving_pod_restarts": restarts(api),
        "pause_after_failure_s": PAUSE_AFTER_FAILURE_S,
        "seconds_without_answer": round(unanswered_seconds(load, start, end), 1),
    }
    if RESULTS:
        Path(RESULTS).write_text(json.dumps(results, indent=1))
    log.info("soak results %s", json.dumps(results))
    assert wrong == [], wrong[:5]
    assert results["status_backwards"] == []
