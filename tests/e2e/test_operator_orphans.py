"""KVEndpoints whose KVTransfer does not exist say so (Orphaned), once, and pair when it appears."""

from __future__ import annotations

import time

import pytest

from kvbridge_operator.config import ENDPOINTS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s


def _status(api: Api, ns: str, name: str) -> dict:
    return api.endpoint(ns, name).get("status") or {}


WRITES = 'kvbridge_status_writes_total{kind="KVEndpoint"}'


def test_endpoint_without_transfer_is_orphaned_once_then_planned(
    api: Api, ns: str, cluster, operator: OperatorProcess
) -> None:
    api.start_engine(ns, "d0", "decode", transfer="llama")
    orphaned = wait_for(lambda: _status(api, ns, "d0-0").get("state") == "Orphaned" and
                        _status(api, ns, "d0-0"), what="d0-0 Orphaned")  # fmt: skip
    assert orphaned["reason"] == "TransferNotFound" and orphaned["peers"] == []
    assert "llama (spec.transferName)" in orphaned["message"] and ns in orphaned["message"]
    assert orphaned["observedEpoch"] == 1
    row = cluster.kubectl("get", "kve", "d0-0", "-n", ns, "--no-headers").stdout.split()
    assert "Orphaned" in row and "TransferNotFound" in row

    # Written once: further events on the endpoint (here labels) send no patch at all (the
    # apiserver would swallow an identical patch, so count what the operator sends).
    writes = operator.metric(WRITES)
    for i in range(3):
        api.patch(ENDPOINTS, ns, "d0-0", {"metadata": {"labels": {"touched": str(i)}}})
    time.sleep(2.0)  # the operator has handled the label events (debounce is 0.1 s here)
    assert operator.metric(WRITES) == writes

    # The KVTransfer appears: the endpoint is planned like any other.
    api.create_transfer(ns, "llama")
    api.start_engine(ns, "p0", "prefill", transfer="llama")
    api.wait_condition(ns, "Paired", "True", name="llama")
    d0 = _status(api, ns, "d0-0")
    assert d0["state"] == "Paired" and [p["name"] for p in d0["peers"]] == ["p0-0"]


def test_deleted_transfer_leaves_its_endpoints_orphaned(
    api: Api, ns: str, operator: OperatorProcess
) -> None:
    api.create_transfer(ns)
    api.start_engine(ns, "p0", "prefill")
    api.start_engine(ns, "d0", "decode")
    api.wait_condition(ns, "Paired", "True")
    api.delete("kvtransfers", ns, "kvt")
    wait_for(lambda: not api.list("kvtransfers", ns), what="KVTransfer gone")
    for name in ("p0-0", "d0-0"):
        s = wait_for(lambda n=name: _status(api, ns, n).get("state") == "Orphaned" and
                     _status(api, ns, n), what=f"{name} Orphaned")  # fmt: skip
        assert s["reason"] == "TransferDeleted" and s["peers"] == []
        assert "KVTransfer kvt (spec.transferName)" in s["message"] and ns in s["message"]
    writes = operator.metric(WRITES)
    api.start_engine(ns, "d1", "decode")  # a new endpoint for the deleted transfer
    s = wait_for(lambda: _status(api, ns, "d1-0").get("reason") == "TransferNotFound" and
                 _status(api, ns, "d1-0"), what="d1-0 TransferNotFound")  # fmt: skip
    assert s["state"] == "Orphaned"
    time.sleep(1.0)
    assert operator.metric(WRITES) == writes + 1  # d1-0 only; d0-0 keeps TransferDeleted

    api.create_transfer(ns)  # recreated: everything pairs again
    wait_for(lambda: api.transfer(ns).get("status", {}).get("pairs", {}).get("total") == 2,
             what="2 pairs after re-creation")  # fmt: skip
    assert {_status(api, ns, n)["state"] for n in ("p0-0", "d0-0", "d1-0")} == {"Paired"}
