"""Operator replicas with leader election, on the real control plane (issue #37).

Two operator processes run as the chart runs its two replicas (``POD_NAME`` their identity,
the Lease ``kvbridge-operator`` in the operator's namespace, the default timing: lease 15 s,
renew deadline 10 s, retry period 2 s), both serving the admission webhook. The leader is
SIGKILLed (an unclean death: no release, as on a lost node); meanwhile a new prefill/decode
pair is created, admitted by the standby's webhook. The test measures when the standby holds
the Lease, checks the new pair gets paired after the hand-over, and records every KVEndpoint
status the API server stores throughout (a watch) to check that none goes backwards and that
the new leader rewrote nothing that was already right.

The session's operator (conftest) steps aside for the test (stopped cleanly, it releases the
Lease) and the webhook configuration points at the standby; both are restored after.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import GROUP, VERSION
from kvbridge_operator.lease import Timing
from kvbridge_operator.webhook import webhook_configuration
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.e2e import Api, lease_holder, wait_for
from kvbridge_testkit.operator_process import OperatorProcess
from kvbridge_testkit.status_recorder import StatusRecorder, backwards

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

TIMING = Timing()  # the chart's defaults
VWC = "kvbridge-validation"  # registered by deploy_operator

#: KVEndpoint states in the order a plan moves an endpoint forward while nothing about it
#: changes (no engine leaves, no epoch changes): Pending, then Paired.
ORDER = {"Pending": 0, "Paired": 1}


class LeaseHolders(threading.Thread):
    """Polls the Lease every 50 ms; ``changes`` holds (monotonic time, holder) on each change."""

    def __init__(self, api_client: Any) -> None:
        super().__init__(daemon=True)
        self.api_client = api_client
        self.changes: list[tuple[float, str | None]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        last: Any = object()
        while not self.stopping.is_set():
            holder = lease_holder(self.api_client)
            if holder != last:
                self.changes.append((time.monotonic(), holder))
                last = holder
            time.sleep(0.05)

    def first(self, holder: str, after: float) -> float | None:
        return next((t for t, h in self.changes if h == holder and t >= after), None)


def _replica(operator: OperatorProcess, name: str) -> OperatorProcess:
    """An operator process as the chart's Deployment runs one pod: its own metrics and
    webhook ports, ``POD_NAME`` = ``name``, everything else as the session's operator."""
    ports = {"metrics": free_port(), "liveness": free_port(), "webhook": free_port()}
    env = {**operator.env, "POD_NAME": name, "KVBRIDGE_METRICS_PORT": str(ports["metrics"]),
           "KVBRIDGE_WEBHOOK_PORT": str(ports["webhook"])}  # fmt: skip
    return OperatorProcess(operator.kubeconfig, operator.workdir, env, ports,
                           log_name=f"{name}-{{start}}.log")  # fmt: skip


def _point_webhook_at(api_client: Any, port: int, cert: Path) -> None:
    admission = client.AdmissionregistrationV1Api(api_client)
    body = webhook_configuration(VWC, cert.read_bytes(), url=f"https://127.0.0.1:{port}")
    current = admission.read_validating_webhook_configuration(VWC)
    body["metadata"]["resourceVersion"] = current.metadata.resource_version
    admission.replace_validating_webhook_configuration(VWC, body)


def _review(port: int, cert: Path, obj: dict[str, Any]) -> dict[str, Any]:
    """An AdmissionReview sent to one replica's webhook directly, as the API server would."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "leader-election-test",
            "operation": "CREATE",
            "object": obj,
            "oldObject": None,
            "kind": {"group": GROUP, "version": VERSION, "kind": obj["kind"]},
            "resource": {"group": GROUP, "version": VERSION,
                         "resource": f"{obj['kind'].lower()}s"},
            "namespace": "default",
            "name": obj["metadata"]["name"],
            "userInfo": {"username": "admin"},
        },
    }
    ctx = ssl.create_default_context(cafile=str(cert))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        conn = http.client.HTTPConnection("127.0.0.1")
        conn.sock = tls
        conn.request("POST", "/validate-kvtransfer", json.dumps(review),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())["response"]


@pytest.fixture
def replicas(cluster: Any, operator: OperatorProcess) -> Iterator[tuple[OperatorProcess, ...]]:
    """Replica ``a`` leading, ``b`` standing by (started once ``a`` holds the Lease, so that
    which one leads is known), the webhook configuration pointing at ``b``. The session's
    operator is stopped first (it releases the Lease) and restarted after."""
    cert = Path(operator.env["KVBRIDGE_WEBHOOK_CERT"])
    a, b = _replica(operator, "replica-a"), _replica(operator, "replica-b")
    operator.stop()
    try:
        a.start()
        wait_for(lambda: lease_holder(cluster.api_client()) == "replica-a", timeout=15,
                 what="replica-a holds the Lease")  # fmt: skip
        b.start()
        _point_webhook_at(cluster.api_client(), b.ports["webhook"], cert)
        yield a, b
    finally:
        for replica in (a, b):
            replica.stop()
        _point_webhook_at(cluster.api_client(), operator.ports["webhook"], cert)
        operator.start()


def test_a_sigkilled_leader_is_replaced_within_the_lease_duration(
    cluster: Any, api: Api, ns: str, replicas: tuple[OperatorProcess, OperatorProcess]
) -> None:
    a, b = replicas
    cert = Path(a.env["KVBRIDGE_WEBHOOK_CERT"])
    recorder = StatusRecorder(cluster.api_client(), ns)
    recorder.start()
    holders = LeaseHolders(cluster.api_client())
    holders.start()
    try:
        api.create_transfer(ns)
        old = [*api.start_engine(ns, "p0", "prefill"), *api.start_engine(ns, "d0", "decode")]
        api.wait_condition(ns, "Paired", "True")
        wait_for(lambda: all(api.endpoint(ns, n)["status"]["state"] == "Paired" for n in old),
                 what="p0 and d0 paired by the leader")  # fmt: skip
        # The standby watched nothing, planned nothing and wrote nothing; both serve the webhook.
        assert (a.metric("kvbridge_operator_leader "), b.metric("kvbridge_operator_leader ")) == (
            1, 0)
        assert b.metric("kvbridge_status_writes_total") == 0
        assert b.metric("kvbridge_reconciles_total") == 0
        invalid = manifests.transfer_manifest("bad", prefill_tp=3, decode_tp=2)
        for replica in (a, b):
            answer = _review(replica.ports["webhook"], cert, invalid)
            assert answer["allowed"] is False and "tp" in answer["status"]["message"].lower()
        time.sleep(TIMING.retry_period * 1.5)  # the leader renews at least once more

        a.kill()  # SIGKILL: no release; the Lease must expire
        killed = time.monotonic()
        # Meanwhile a new pair is created: the webhook (on the standby) admits it.
        new = [*api.start_engine(ns, "p1", "prefill"), *api.start_engine(ns, "d1", "decode")]
        created = time.monotonic()
        taken = wait_for(lambda: holders.first("replica-b", killed), timeout=60, interval=0.05,
                         what="replica-b holds the Lease")  # fmt: skip
        took = taken - killed
        print(f"\nSIGKILL hand-over: replica-b held the Lease {took:.2f} s after replica-a was "
              f"killed (lease {TIMING.lease_duration} s, retry period {TIMING.retry_period} s)")
        assert created < taken, "the new pair was meant to be admitted while only the standby ran"
        bound = TIMING.lease_duration + TIMING.retry_period
        # Protocol bounds: no sooner than the Lease can expire (the leader renewed at most a
        # retry period before it died), no later than expiry plus the standby's next try
        # (+1 s for the API calls and this test's polling on a loaded machine).
        assert TIMING.lease_duration - TIMING.retry_period - 1.0 <= took <= bound + 1.0, took

        # The pair created meanwhile is paired by the new leader.
        wait_for(lambda: all(api.endpoint(ns, n).get("status", {}).get("state") == "Paired"
                             for n in new), timeout=30, what="p1 and d1 paired after the hand-over")
        paired_at = time.monotonic()
        print(f"the new pair was Paired {paired_at - taken:.2f} s after the hand-over "
              f"({paired_at - killed:.2f} s after the SIGKILL)")
        wait_for(lambda: api.condition(ns, "Paired").get("status") == "True", what="Paired")
        assert b.metric("kvbridge_operator_leader ") == 1
        assert b.metric("kvbridge_operator_leader_transitions_total{change=\"acquired\"}") == 1
        time.sleep(1.0)  # a late write would show up in the recorder by now
    finally:
        holders.stopping.set()
        recorder.stop()

    for name, history in recorder.seen.items():
        states = [s.get("state") for _, s in history if s]
        # No status goes backwards: states only move forward (and, below, observed
        # generation and epoch never decrease).
        ranks = [ORDER[s] for s in states if s in ORDER]
        assert ranks == sorted(ranks), f"{name}: {states}"
    assert backwards(recorder.seen) == []
    for name in old:
        # Nothing the old leader wrote was rewritten by the new one (it re-planned the same).
        after = [s for t, s in recorder.seen[name] if t > killed]
        assert after == [], f"{name} rewritten after the hand-over: {after}"
    for name in new:
        states = [s.get("state") for t, s in recorder.seen[name] if s]
        assert states == ["Paired"], f"{name}: written {states} (once, by the new leader)"
    assert "taking over" in b.log()
