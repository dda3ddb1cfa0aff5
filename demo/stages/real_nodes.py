"""The demo on two real kubelet nodes (kvbridge_testkit.node): the chart's operator Deployment
and the serving pods run as containers from images built here."""

from __future__ import annotations

import subprocess
from typing import Any

from kvbridge_testkit import cluster as kc

from .admission import wait_webhook_answering
from .common import NS, OPERATOR_METRICS_PORT, RELEASE, REPO, SYS_NS, Stage, say
from .serving import serve_vllm


def setup_node(binaries: kc.Binaries, cleanup: list) -> Stage:
    """Two real nodes on one pod network; the chart's operator Deployment and the serving
    pods run as containers."""
    from kubernetes import client

    from kvbridge_testkit import node as kn
    from kvbridge_testkit.node_pods import (
        NodePod,
        agent_pod,
        image_values,
        in_zone,
        ready_pod,
        two_nodes,
    )
    from kvbridge_testkit.sim import wait_until

    node_binaries = kn.NodeBinaries.find()
    say("node images: operator and agent from the Dockerfile, built with buildah over a Debian "
        "base (hack/node-images.sh; ~3 minutes the first time, then cached) ...")
    images = kn.node_images(build=True)
    nodes = two_nodes(images, binaries=node_binaries)
    cleanup.append(lambda: kn.stop_all(nodes))  # also when the cluster never comes up
    for node in nodes:
        node.link_up()
    say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler ...")
    cluster = kc.LocalCluster(binaries=binaries, address=kn.HOST_IP, real_nodes=True,
                              service_cidr=kn.SERVICE_CIDR).start()
    cleanup.append(cluster.stop)
    say("starting two nodes: containerd, kubelet and kube-proxy, each in network and mount "
        "namespaces of their own, one pod network over both ...")
    cleanup.append(lambda: kn.stop_all(nodes))  # before the apiserver goes: pods go through it
    kn.start_all(nodes, cluster)
    k = cluster.kubectl
    for node in nodes:
        labels = ", ".join(f"{key}={value}" for key, value in node.labels.items())
        say(f"node {node.name} Ready ({labels}"
            f"{', tainted ' + ' '.join(node.taints) if node.taints else ''}; pods in "
            f"{node.net.pod_cidr}; images {', '.join(node.image_names()[:3])})")
    say(f"control plane up at {cluster.server} (kubelet {kc.KUBE_VERSION})")

    k("create", "namespace", NS)
    values = image_values(images["KVB_IMAGE_OPERATOR"])
    say(f"helm install kvbridge charts/kvbridge {' '.join(values)} --wait ...")
    subprocess.run(
        [str(binaries.helm), "install", RELEASE, str(REPO / "charts" / "kvbridge"),
         "--kubeconfig", str(cluster.kubeconfig), "-n", SYS_NS, "--create-namespace",
         *values, "--set", f"agent.namespaces={{{NS}}}", "--wait", "--timeout=180s"],
        check=True, capture_output=True, text=True, timeout=240)
    wait_webhook_answering(cluster)
    say("operator Deployment Ready (non-root, read-only root filesystem, in-cluster token); "
        "the apiserver calls its admission webhook through the kvbridge-webhook Service")
    core = client.CoreV1Api(cluster.api_client())

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int, zone: str | None
                  ) -> tuple[Any, str]:  # fmt: skip
        pod = agent_pod(name, role, images["KVB_IMAGE_AGENT"], engine_id=engine, preset=preset,
                        seed=seed, service_account=f"{RELEASE}-agent")
        core.create_namespaced_pod(NS, in_zone(pod, zone) if zone else pod)
        pod = wait_until(lambda: ready_pod(core, NS, name), timeout=120, interval=0.5,
                         what=f"pod {name} Ready")
        handle = NodePod(name, pod.status.pod_ip, engine_id=engine, preset=preset)
        status = handle.status()
        return handle, (f"container on {pod.spec.node_name}, pod IP {pod.status.pod_ip}, "
                        f"agent epoch {status['epoch']} side channel port {status['port']}")

    def delete_pod(name: str, _handle: Any) -> None:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)

    # The host routes the pod network to the node: Prometheus here scrapes pod IPs directly.
    # The chart runs two operator replicas; the one holding the Lease plans and exports the
    # KVTransfer metrics.
    from kvbridge_testkit.e2e import lease_holder

    holder = wait_until(lambda: lease_holder(cluster.api_client(), SYS_NS, f"{RELEASE}-operator"),
                        timeout=60, interval=0.5, what="an operator replica holding the Lease")
    say(f"operator replicas: {holder} leads (Lease {SYS_NS}/{RELEASE}-operator), the other "
        "stands by and serves the webhook")
    operator = core.read_namespaced_pod(holder, SYS_NS)
    return Stage(cluster, start_pod,
                 operator_metrics=f"{operator.status.pod_ip}:{OPERATOR_METRICS_PORT}",
                 delete_pod=delete_pod,
                 serve_vllm=lambda: serve_vllm(cluster, images, binaries.helm))
