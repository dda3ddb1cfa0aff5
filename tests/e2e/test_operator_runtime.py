"""The operator process: least-privilege RBAC, metrics, liveness, events, finalizer, and a
standby replica taking over from a leader stopped cleanly."""

from __future__ import annotations

import time

import pytest

from kvbridge_operator.config import FINALIZER
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.e2e import Api, http_get, lease_holder, wait_for
from kvbridge_testkit.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s

SA = "system:serviceaccount:kvbridge-system:kvbridge-operator"


@pytest.mark.parametrize(("verb", "resource", "allowed"), [
    ("patch", "kvendpoints.kvbridge.io/status", True),
    ("patch", "kvtransfers.kvbridge.io/status", True),
    ("watch", "kvendpoints.kvbridge.io", True),
    ("patch", "kvtransfers.kvbridge.io", True),
    ("create", "events", True),
    ("list", "nodes", True),
    ("update", "kvendpoints.kvbridge.io", False),  # spec belongs to the agent
    ("delete", "kvendpoints.kvbridge.io", False),
    ("create", "kvtransfers.kvbridge.io", False),
    ("get", "secrets", False),
    ("list", "pods", False),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io", False),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", True),  # kopf's resource scan
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", False),
    ("create", "leases.coordination.k8s.io", True),  # leader election
    ("update", "leases.coordination.k8s.io/kvbridge-operator", True),
    ("update", "leases.coordination.k8s.io/kube-controller-manager", False),
    ("delete", "leases.coordination.k8s.io/kvbridge-operator", False),
    ("list", "leases.coordination.k8s.io", False),
])  # fmt: skip
def test_operator_rbac_is_least_privilege(cluster, operator, verb: str, resource: str,
                                          allowed: bool) -> None:  # fmt: skip
    resource, _, sub = resource.partition("/")
    if resource.startswith("leases."):  # a named Lease, not a subresource
        resource, sub = f"{resource}/{sub}" if sub else resource, ""
    extra = [f"--subresource={sub}"] if sub else []
    out = cluster.kubectl("auth", "can-i", verb, resource, *extra, f"--as={SA}", "-A", check=False)
    assert out.stdout.strip() == ("yes" if allowed else "no"), out.stderr


def test_operator_never_hits_forbidden(operator: OperatorProcess, api: Api, ns: str) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "Paired", "True")
    log = operator.log()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]


def test_metrics_and_liveness(operator: OperatorProcess, api: Api, ns: str) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "dbad", "decode", geometry={"kvCacheLayout": "NHD", "isMla": False})
    api.wait_condition(ns, "GeometryCompatible", "False")
    assert http_get(operator.liveness_url)[0] == 200
    _, text = http_get(operator.metrics_url)
    assert "kvbridge_reconciles_total" in text
    assert "kvbridge_reconcile_duration_seconds_bucket" in text
    line = f'kvbridge_incompatible_pairs{{namespace="{ns}",transfer="kvt"}} 1.0'
    wait_for(lambda: line in http_get(operator.metrics_url)[1], what=line)
    assert (f'kvbridge_endpoints{{namespace="{ns}",role="decode",state="Incompatible",'
            f'transfer="kvt"}} 1.0') in http_get(operator.metrics_url)[1]  # fmt: skip


def test_failed_handshake_is_reported_with_a_warning_event(api: Api, ns: str) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "Paired", "True")
    api.report_handshakes(ns, ok=False, message="NIXL_ERR_BACKEND in loadRemoteMD")
    hs = api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakeFailed")
    assert "d0-0" in hs["message"] and "NIXL_ERR_BACKEND" in hs["message"]
    assert api.condition(ns, "Degraded")["reason"] == "HandshakeFailed"
    events = wait_for(lambda: [e for e in api.core.list_namespaced_event(ns).items
                               if e.reason == "HandshakeFailed"], what="event")  # fmt: skip
    assert events[0].type == "Warning"


def test_deleting_a_transfer_withdraws_peers(api: Api, ns: str) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "Paired", "True")
    assert FINALIZER in api.transfer(ns)["metadata"]["finalizers"]
    api.delete("kvtransfers", ns, "kvt")
    wait_for(lambda: api.endpoint(ns, "d0-0")["status"]["reason"] == "TransferDeleted",
             what="peers withdrawn")  # fmt: skip
    assert api.endpoint(ns, "d0-0")["status"]["peers"] == []
    wait_for(lambda: not api.list("kvtransfers", ns), what="KVTransfer gone")


def test_standby_replica_takes_over_from_a_clean_stop(
    cluster, operator: OperatorProcess, api: Api, ns: str
) -> None:
    """A second replica on the same Lease stands by: it writes nothing while the first leads.
    The leader stopped cleanly (SIGTERM, as in a rolling update) releases the Lease on its way
    out, so the standby leads at its next try (a retry period, 2 s), not after the lease
    duration (15 s), and carries on planning."""
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakesPending")
    leader = lease_holder(cluster.api_client())
    assert leader, "the session's operator holds the Lease"
    ports = {"metrics": free_port(), "liveness": free_port()}
    standby = OperatorProcess(operator.kubeconfig, operator.workdir / "standby",
                              {**operator.env, "KVBRIDGE_WEBHOOK_PORT": "0",
                               "KVBRIDGE_METRICS_PORT": str(ports["metrics"])}, ports)  # fmt: skip
    standby.workdir.mkdir(exist_ok=True)
    standby.start()
    try:
        time.sleep(3)
        assert standby.metric("kvbridge_operator_leader ") == 0
        assert standby.metric("kvbridge_status_writes_total") == 0
        assert lease_holder(cluster.api_client()) == leader
        operator.stop()  # returns once the process exited: the Lease is released by then
        stopped = time.monotonic()
        wait_for(lambda: lease_holder(cluster.api_client()) not in ("", leader), timeout=15,
                 interval=0.05, what="the standby holds the Lease")  # fmt: skip
        took = time.monotonic() - stopped
        print(f"clean hand-over: the standby held the Lease {took:.2f} s after the leader exited")
        assert took < 15 - 2, f"hand-over took {took:.2f} s: as long as an expiry, not a release"
        api.report_handshakes(ns)
        api.wait_condition(ns, "Ready", "True", timeout=60)
        assert standby.metric("kvbridge_operator_leader ") == 1
        assert "Standing by until" in standby.log()
    finally:
        standby.stop()
        if operator.proc is None:
            operator.start()
