"""Pod-to-pod pull on two real kubelet nodes: the agent against a raw NIXL READ of the same
descriptors between the same two pods, on one node and across nodes.

Stands up what ``make demo`` runs (a local control plane, two nodes in two zones on one pod
network, the chart's operator from the local image; kvbridge_testkit.node) with three agent
pods from the agent image: a prefill and a decode on the first node, a decode on the second.
Once both decodes have preflighted the prefill, each runs ``bench_pull`` (pod_agent.py):
every block of 4 regions (256 descriptors of 16 KiB, 4 MiB) read through the agent's ``pull``,
as one raw prepared NIXL READ over the agent's own prepared lists and descriptor ids, and as
that READ carrying the completion notification, interleaved rep by rep in a random order and
timed around each call inside the pod; the median of ``KVB_BENCH_REPS`` reps (default 25) is
reported.

Lines: ``pods.pull.one_node`` and ``pods.pull.across_nodes`` (agent GB/s; ratio agent / raw
throughput, higher is better, 1.0 = the agent adds nothing over NIXL; ``vs_raw_notified``
against the raw READ carrying the same completion notification, which the protocol requires),
and ``pods.pull.across_vs_one_node`` (the agent across nodes / on one node). Needs root and
the node images (``make node-images``); about 2 minutes, most of it the nodes starting.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import emit
from kvbridge_testkit import REPO
from kvbridge_testkit.node_pods import (
    ZONES,
    agent_call,
    agent_pod,
    bench_pull,
    handshakes_succeeded,
    image_values,
    in_zone,
    ready_pod,
    two_nodes,
)
from kvbridge_testkit.sim import wait_until

REPS = int(os.environ.get("KVB_BENCH_REPS", "25"))
NS, RELEASE, SYS_NS = "kvb-bench", "kvbridge", "kvbridge-system"
PODS = {"prefill-a": ZONES[0], "decode-a": ZONES[0], "decode-b": ZONES[1]}


def deploy(cluster: Any, helm: Path, images: dict[str, str]) -> dict[str, str]:
    """The chart, a KVTransfer and the three agent pods; returns pod IP by name."""
    import yaml
    from kubernetes import client

    from kvbridge_operator import testing as manifests

    cluster.kubectl("create", "namespace", NS)
    subprocess.run([str(helm), "install", RELEASE, str(REPO / "charts" / "kvbridge"),
                    "--kubeconfig", str(cluster.kubeconfig), "-n", SYS_NS, "--create-namespace",
                    *image_values(images["KVB_IMAGE_OPERATOR"]),
                    "--set", f"agent.namespaces={{{NS}}}", "--wait", "--timeout=180s"],
                   check=True, capture_output=True, text=True, timeout=240)  # fmt: skip
    transfer = yaml.safe_dump(manifests.transfer_manifest("kvt", NS))
    wait_until(lambda: cluster.kubectl("apply", "-f", "-", input=transfer, check=False
                                       ).returncode == 0, timeout=120, interval=0.5,
               what="the KVTransfer admitted by the webhook")  # fmt: skip
    core = client.CoreV1Api(cluster.api_client())
    for name, zone in PODS.items():
        core.create_namespaced_pod(NS, in_zone(agent_pod(name, name.split("-")[0],
                                                         images["KVB_IMAGE_AGENT"]), zone))
    return {name: wait_until(lambda n=name: ready_pod(core, NS, n), timeout=120, interval=0.5,
                             what=f"pod {name} Ready").status.pod_ip for name in PODS}


def measure(ips: dict[str, str], decode: str) -> dict[str, Any]:
    wait_until(lambda: handshakes_succeeded(ips[decode]), timeout=120, interval=0.5,
               what=f"{decode} preflighted prefill-a")
    out = bench_pull(ips[decode], ips["prefill-a"], "prefill-a", REPS, timeout=600)
    if not (out.get("ok") and out.get("verified")):
        raise RuntimeError(f"{decode}: {out}")
    shake = next(h for h in agent_call(ips[decode], {"cmd": "status"})["handshakes"]
                 if h["peer"].startswith("prefill-a"))  # fmt: skip
    return out | {"transport": f"{shake.get('transport')} ({shake.get('transportDetail')})"}


def main() -> None:
    from kvbridge_testkit import cluster as kc
    from kvbridge_testkit import node as kn

    t0 = time.monotonic()
    binaries = kc.Binaries.find()
    images = kn.node_images()
    nodes = two_nodes(images, binaries=kn.NodeBinaries.find())
    with contextlib.ExitStack() as stack:
        stack.callback(kn.stop_all, nodes)  # also when the cluster never comes up: the links go
        for node in nodes:
            node.link_up()
        cluster = stack.enter_context(kc.LocalCluster(
            binaries=binaries, address=kn.HOST_IP, real_nodes=True,
            service_cidr=kn.SERVICE_CIDR))  # fmt: skip
        stack.callback(kn.stop_all, nodes)  # before the apiserver goes
        kn.start_all(nodes, cluster)
        ips = deploy(cluster, binaries.helm, images)
        print(f"# nodes and pods up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        results = {where: measure(ips, decode)
                   for where, decode in (("one_node", "decode-a"), ("across_nodes", "decode-b"))}
        for where, r in results.items():
            emit(f"pods.pull.{where}", r["agent_gbps"], "GB/s",
                 "a raw NIXL READ of the same 256 descriptors between the same two pods",
                 round(r["ratio"], 3), raw_gbps=round(r["raw_gbps"], 3),
                 raw_notified_gbps=round(r["raw_notified_gbps"], 3),
                 vs_raw_notified=round(r["agent_gbps"] / r["raw_notified_gbps"], 3),
                 agent_ms=round(r["agent_ms"], 2), raw_ms=round(r["raw_ms"], 2),
                 raw_notified_ms=round(r["raw_notified_ms"], 2),
                 nbytes=r["nbytes"], reps=r["reps"], transport=r["transport"],
                 higher_is_better=True)  # fmt: skip
        one, across = (results[k]["agent_gbps"] for k in ("one_node", "across_nodes"))
        emit("pods.pull.across_vs_one_node", across, "GB/s",
             "the same pull through the agent between two pods on one node",
             round(across / one, 3), one_node_gbps=round(one, 3), higher_is_better=True)
    print(f"# bench_pods took {time.monotonic() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
