"""The demo where no real node can run: a node simulator, the operator as a local process with
the chart's ServiceAccount token, and each pod an agent process (kvbridge_testkit.sim)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from kvbridge_testkit import cluster as kc

from .admission import register_webhook
from .common import NS, RELEASE, REPO, SYS_NS, Stage, say


def setup_simulated(binaries: kc.Binaries, cleanup: list) -> Stage:
    """A node simulator; the operator is a local process and each pod an agent process."""
    from kvbridge_testkit.sim import SimPod

    say("starting etcd, kube-apiserver, kube-controller-manager ...")
    cluster = kc.LocalCluster(binaries=binaries).start()
    cleanup.append(cluster.stop)
    kubelet = kc.FakeKubelet(cluster.api_client(), {"node-a": {}}).start()
    cleanup.append(kubelet.stop)
    k = cluster.kubectl
    say(f"control plane up at {cluster.server}; node simulator registered node-a")

    k("create", "namespace", NS)
    say("helm install kvbridge charts/kvbridge (CRDs, RBAC, agent ServiceAccount) ...")
    subprocess.run(
        [str(binaries.helm), "install", RELEASE, str(REPO / "charts" / "kvbridge"),
         "--kubeconfig", str(cluster.kubeconfig), "-n", SYS_NS, "--create-namespace",
         "--set", "operator.replicas=0", "--set", "webhook.enabled=false",
         "--set", f"agent.namespaces={{{NS}}}", "--wait=false"],
        check=True, capture_output=True, text=True, timeout=120)
    k("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")

    say("starting the operator (kopf run, chart's operator ServiceAccount token, admission "
        "webhook on loopback TLS) ...")
    token = k("create", "token", RELEASE, "-n", SYS_NS, "--duration=3600s").stdout.strip()
    kubeconfig = cluster.kubeconfig_for_token(token, "operator")
    ports = {k: kc.free_port() for k in ("liveness", "webhook", "metrics")}
    from kvbridge_operator.webhook import self_signed_certificate
    from kvbridge_testkit.operator_process import OperatorProcess, loopback_settings

    cert, key = self_signed_certificate(Path(cluster.workdir) / "webhook",
                                        ["127.0.0.1", "localhost"])
    op = OperatorProcess(
        kubeconfig, Path(cluster.workdir),
        {"KVBRIDGE_LEADER_ELECTION": "false", **loopback_settings(ports, cert, key),
         "KVBRIDGE_DEBOUNCE": "0.1", "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'agent'}"},
        ports, log_name="operator.log", stop_timeout=15)
    cleanup.append(op.stop)
    try:
        op.start()
    except AssertionError as exc:
        raise SystemExit(f"the operator did not start ({str(exc).splitlines()[0]}); see its "
                         f"log in {op.log_path}") from None
    webhook_port, metrics_port = ports["webhook"], ports["metrics"]
    register_webhook(cluster, webhook_port, Path(cert).read_bytes(), cleanup)
    say(f"admission webhook registered (https://127.0.0.1:{webhook_port}, "
        "ValidatingWebhookConfiguration kvbridge-validation) and answering")

    pods: list[SimPod] = []
    cleanup.append(lambda: [p.close() for p in pods])

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int,
                  _zone: str | None) -> tuple[Any, str]:  # fmt: skip
        """Every simulated pod on the one simulated node (the zone is for real nodes)."""
        pod = SimPod(cluster, NS, name, role=role, engine_id=engine, preset=preset,
                     seed=seed, sa=f"{RELEASE}-agent", extra_args=["--metrics-port", "0"])
        pods.append(pod)
        ready = pod.start()
        return pod, (f"agent process pid {ready['pid']} epoch {ready['epoch']} side channel "
                     f"127.0.0.1:{ready['port']}, metrics 127.0.0.1:{ready['metrics_port']}")

    def delete_pod(_name: str, pod: SimPod) -> None:
        pod.close()
        pod.delete_pod()

    return Stage(cluster, start_pod, operator_metrics=f"127.0.0.1:{metrics_port}",
                 delete_pod=delete_pod)
