"""The operator process: least-privilege RBAC, metrics, liveness, events, finalizer, peering."""

from __future__ import annotations

import time

import pytest

from kvbridge_operator.config import FINALIZER
from kvbridge_testkit.cluster import free_port
from kvbridge_testkit.e2e import Api, http_get, wait_for
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
])  # fmt: skip
def test_operator_rbac_is_least_privilege(cluster, operator, verb: str, resource: str,
                                          allowed: bool) -> None:  # fmt: skip
    resource, _, sub = resource.partition("/")
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


def test_standby_replica_takes_over(operator: OperatorProcess, api: Api, ns: str) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "HandshakesVerified", "False", reason="HandshakesPending")
    ports = {**operator.ports, "metrics": free_port(), "liveness": free_port()}  # fmt: skip
    standby = OperatorProcess(operator.kubeconfig, operator.workdir / "standby",
                              {**operator.env, "KVBRIDGE_WEBHOOK_PORT": "0",
                               "KVBRIDGE_METRICS_PORT": str(ports["metrics"])}, ports)  # fmt: skip
    standby.workdir.mkdir(exist_ok=True)
    standby.extra_args = ["--priority=-10"]
    standby.start()
    try:
        time.sleep(3)  # kopf starts paused and stays silent while a higher priority peer lives
        assert "Resuming operations" not in standby.log()
        operator.stop()
        api.report_handshakes(ns)
        api.wait_condition(ns, "Ready", "True", timeout=60)
        assert "Resuming operations" in standby.log()
    finally:
        standby.stop()
        if operator.proc is None:
            operator.start()
