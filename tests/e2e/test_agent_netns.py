"""Prefill and decode agents in separate network namespaces joined by a veth pair: the side
channel and NIXL (UCX over TCP) cross a real interface; cutting the link fails the transfer
cleanly within its deadline (typed failure, no completion notification).

Only addresses inside the test's own namespaces (10.213.x.y/30) and loopback are used; the
agents reach the apiserver through a unix-socket bridge (kvbridge_testkit.bridge). Namespaces
and links are always removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.sim import SimPod, create_agent_rbac, handshakes_ok

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow]

SEED = 5
LOCAL = [[1, 2, 3], [4]]
REMOTE = [[7, 8, 9], [30]]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16) % 250 + 1
    n = {"p": f"kvbp-{tag}", "d": f"kvbd-{tag}", "pdev": f"kvp{tag}", "ddev": f"kvd{tag}",
         "pip": f"10.213.{octet}.1", "dip": f"10.213.{octet}.2"}
    try:
        ip("netns", "add", n["p"])
        ip("netns", "add", n["d"])
        ip("link", "add", n["pdev"], "type", "veth", "peer", "name", n["ddev"])
        ip("link", "set", n["pdev"], "netns", n["p"])
        ip("link", "set", n["ddev"], "netns", n["d"])
        for side in ("p", "d"):
            dev, addr = n[f"{side}dev"], n[f"{side}ip"]
            ip("-n", n[side], "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", n[side], "link", "set", dev, "up")
            ip("-n", n[side], "link", "set", "lo", "up")
        yield n
    finally:
        for side in ("p", "d"):
            subprocess.run(["ip", "netns", "del", n[side]], capture_output=True, timeout=10)


def test_transfer_across_veth_and_link_cut_fails_cleanly(cluster, api: Api, ns: str,
                                                          netns: dict[str, str]) -> None:
    create_agent_rbac(cluster.api_client(), ns)
    api.create_transfer(ns)
    env = {"UCX_TLS": "tcp"}
    p = SimPod(cluster, ns, "p-0", role="prefill", engine_id="P", seed=SEED, host=netns["pip"],
               netns=netns["p"], env={**env, "UCX_NET_DEVICES": netns["pdev"]})
    d = SimPod(cluster, ns, "d-0", role="decode", engine_id="D", seed=SEED, host=netns["dip"],
               netns=netns["d"], env={**env, "UCX_NET_DEVICES": netns["ddev"]})
    try:
        p.start()
        d.start()
        wait_for(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=60, what="preflight")
        assert api.endpoint(ns, "p-0")["spec"]["sideChannel"]["host"] == netns["pip"]
        # The transport UCX picked is reported per peer, down to the interface it crosses.
        [hs] = wait_for(lambda: (api.endpoint(ns, "d-0").get("status") or {}).get("handshakes"),
                        timeout=30, what="the decode's handshake published")  # fmt: skip
        assert (hs["transport"], hs["transportDetail"]) == ("tcp", f"tcp/{netns['ddev']}")
        p.call("hold", request_ids=["n1"])
        res = d.call("pull", request_id="n1", remote_engine_id="P", local_block_ids=LOCAL,
                     remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=10.0)
        assert res["ok"] and res["verified"], res
        wait_for(lambda: "n1" in p.call("completions")["finished"], timeout=10, what="n1")

        ip("-n", netns["d"], "link", "set", netns["ddev"], "down")
        p.call("hold", request_ids=["n2"], lease_s=60)
        cut = d.call("pull", request_id="n2", remote_engine_id="P", local_block_ids=LOCAL,
                     remote_block_ids=REMOTE, timeout_s=2.0)
        assert not cut["ok"], cut
        assert cut["cause"] in ("timeout", "remote_disconnect", "transfer"), cut
        ip("-n", netns["d"], "link", "set", netns["ddev"], "up")
        # Heartbeats may flow again, but the failed request's completion is never sent.
        done = p.call("completions")
        assert "n2" not in done["finished"]
    finally:
        d.close()
        p.close()
