"""Did a vLLM pod take a request while it should have taken none: before it was Ready, or
after it was marked for deletion? Read from the engines' own counters, not from the router.

An engine's *started* count is what its Prometheus page says it has taken: requests finished
(``vllm:request_success_total``) plus those running and waiting. Each poll scrapes every pod
first and reads the pods' state after: a pod that is still not Ready after the scrape was not
Ready during it, so any request the scrape counts came in before readiness; a pod first seen
terminating is scraped after it was seen, so the count then is a baseline that includes every
request sent before the deletion, and any later growth is a request sent to a terminating pod.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbridge_testkit.vllm_pods import DECODE_HTTP_PORT, HTTP_PORT, metric_sum, pod_ready, scrape

STARTED = ("vllm:request_success_total", "vllm:num_requests_running",
           "vllm:num_requests_waiting")  # fmt: skip


def started(ip: str, port: int) -> float | None:
    """Requests the engine at ``ip:port`` has taken; None when it does not answer."""
    try:
        metrics = scrape(ip, port)
    except OSError:
        return None
    return sum(metric_sum(metrics, name) for name in STARTED)


@dataclass
class PodAudit:
    #: requests counted on a pod before it was Ready (pod -> count)
    before_ready: dict[str, float] = field(default_factory=dict)
    #: requests a pod took after it was first seen terminating (pod -> count)
    while_terminating: dict[str, float] = field(default_factory=dict)
    #: pods seen terminating, with their count then
    terminating: dict[str, float] = field(default_factory=dict)

    @property
    def violations(self) -> dict[str, str]:
        out = {p: f"{n:g} request(s) before Ready" for p, n in self.before_ready.items() if n}
        out.update({p: f"{n:g} request(s) while terminating"
                    for p, n in self.while_terminating.items() if n})
        return out


def _port(pod: Any) -> int:
    return DECODE_HTTP_PORT if pod.metadata.labels.get("kvbridge.io/role") == "decode" \
        else HTTP_PORT


@contextlib.contextmanager
def pod_audit(core: Any, ns: str, selector: str, interval: float = 0.5) -> Iterator[PodAudit]:
    """Watch the pods ``selector`` picks in ``ns`` while the block runs."""
    audit, stop = PodAudit(), threading.Event()
    ips: dict[str, tuple[str, int]] = {}
    was_ready: set[str] = set()

    def poll() -> None:
        while not stop.wait(interval):
            counts = {name: started(ip, port) for name, (ip, port) in ips.items()}
            try:
                pods = core.list_namespaced_pod(ns, label_selector=selector).items
            except Exception:
                continue
            for pod in pods:
                name = pod.metadata.name
                if pod.status.pod_ip:
                    ips[name] = (pod.status.pod_ip, _port(pod))
                count = counts.get(name)
                if pod.metadata.deletion_timestamp is not None:
                    if name not in audit.terminating:
                        baseline = started(*ips[name]) if name in ips else None
                        audit.terminating[name] = baseline or 0.0
                    elif count is not None:
                        audit.while_terminating[name] = count - audit.terminating[name]
                elif pod_ready(pod):
                    was_ready.add(name)
                elif count and name not in was_ready:
                    audit.before_ready[name] = count

    thread = threading.Thread(target=poll, daemon=True, name="pod-audit")
    thread.start()
    try:
        yield audit
    finally:
        stop.set()
        thread.join()
