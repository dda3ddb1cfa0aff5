"""The router's routing table follows pods on a real control plane (issue #37): a verified pair
takes no new request the moment a pod of it gets its deletion timestamp or loses readiness,
while its KVEndpoints still say Paired and verified; it comes back when readiness does. Without
the pods permission the router serves on the endpoints alone and says why.

The watch (``TransferWatch``, the router's and the picker's) runs here against the API server
with the operator pairing the endpoints and the decodes' handshakes written as agents write
them. A finalizer keeps a deleted pod in Terminating, as a preStop drain does on a real node.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvbridge_agent.resources import ENDPOINTS
from kvbridge_router.watch import TransferWatch
from kvbridge_testkit import cluster as kc
from kvbridge_testkit.e2e import Api, wait_for

pytestmark = pytest.mark.k8s

HOLD = "kvbridge.io/test-hold"


@pytest.fixture
def verified(api: Api, ns: str) -> Iterator[str]:
    """One prefill and two decodes of KVTransfer kvt in ``ns``, paired and verified."""
    api.create_transfer(ns, prefill_tp=1, decode_tp=1)
    for engine, role in (("p", "prefill"), ("d0", "decode"), ("d1", "decode")):
        api.start_engine(ns, engine, role, tp_size=1)
    wait_for(lambda: api.report_handshakes(ns) == 0 and all(
        (e.get("status") or {}).get("handshakes") for n, e in api.endpoints(ns).items()
        if n.startswith("d")), timeout=60, what="decodes paired and verified")
    yield ns
    for pod in api.core.list_namespaced_pod(ns).items:   # let held pods go
        if pod.metadata.finalizers:
            api.core.patch_namespaced_pod(pod.metadata.name, ns, {"metadata": {"finalizers": None}})


def _pairs(watch: TransferWatch) -> dict[str, tuple[str, ...]]:
    return dict(watch.table.pairs)


def _set_ready(api: Api, ns: str, pod: str, ready: bool) -> None:
    api.core.patch_namespaced_pod_status(pod, ns, {"status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}})


def test_a_pair_is_held_back_while_a_pod_terminates_or_is_not_ready(
        cluster: kc.LocalCluster, api: Api, verified: str) -> None:
    ns = verified
    watch = TransferWatch(cluster.api_client(), ns, "kvt").start()
    try:
        both = {"d0": ("p",), "d1": ("p",)}
        wait_for(lambda: _pairs(watch) == both, what="both pairs in the routing table")

        # d0's pod deleted (held in Terminating): out at once, its endpoint still verified
        api.core.patch_namespaced_pod("d0-0", ns, {"metadata": {"finalizers": [HOLD]}})
        api.core.delete_namespaced_pod("d0-0", ns)
        wait_for(lambda: _pairs(watch) == {"d1": ("p",)}, timeout=10, what="d0 held back")
        assert watch.table.held == {"d0": "pod d0-0 terminating"}
        endpoint = api.get(ENDPOINTS, ns, "d0-0")
        assert endpoint["status"]["state"] == "Paired" and endpoint["status"]["handshakes"]
        assert not endpoint["metadata"].get("deletionTimestamp")

        # the prefill's readiness lost: nothing to route, the reason names the pod
        _set_ready(api, ns, "p-0", False)
        wait_for(lambda: not watch.table.pairs, timeout=10, what="every pair held back")
        assert "p: pod p-0 not Ready" in watch.table.reason
        assert "d0: pod d0-0 terminating" in watch.table.reason

        # readiness back: d1's pair is back; d0 stays out while its pod terminates
        _set_ready(api, ns, "p-0", True)
        wait_for(lambda: _pairs(watch) == {"d1": ("p",)}, timeout=10, what="p back")

        # the pod gone: its endpoint is collected, the table stays as it is
        api.core.patch_namespaced_pod("d0-0", ns, {"metadata": {"finalizers": None}})
        wait_for(lambda: "d0-0" not in api.endpoints(ns), timeout=30, what="d0-0 collected")
        assert _pairs(watch) == {"d1": ("p",)} and watch.table.held == {}
    finally:
        watch.stop()


def test_without_the_pods_permission_the_endpoints_decide_and_the_log_says_so(
        cluster: kc.LocalCluster, api: Api, verified: str, caplog: pytest.LogCaptureFixture
) -> None:
    ns = verified
    sa = "router-no-pods"
    cluster.kubectl("-n", ns, "create", "serviceaccount", sa)
    cluster.kubectl("-n", ns, "create", "role", sa, "--verb=get,list,watch",
                    "--resource=kvtransfers.kvbridge.io,kvendpoints.kvbridge.io")
    cluster.kubectl("-n", ns, "create", "rolebinding", sa, f"--role={sa}",
                    f"--serviceaccount={ns}:{sa}")
    token = cluster.kubectl("-n", ns, "create", "token", sa).stdout.strip()
    kubeconfig = cluster.kubeconfig_for_token(token, f"{ns}-{sa}")
    from kvbridge_agent.kube import api_client

    caplog.set_level(logging.ERROR, logger="kvbridge.router.watch")
    watch = TransferWatch(api_client(str(kubeconfig)), ns, "kvt").start()
    try:
        wait_for(lambda: _pairs(watch) == {"d0": ("p",), "d1": ("p",)}, what="pairs by endpoints")
        _set_ready(api, ns, "p-0", False)
        wait_for(lambda: "may not list pods" in caplog.text, what="the missing permission logged")
        assert _pairs(watch) == {"d0": ("p",), "d1": ("p",)}   # as before pods were followed
    finally:
        watch.stop()
        _set_ready(api, ns, "p-0", True)

