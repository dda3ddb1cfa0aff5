"""`make demo`: kvbridge end to end on this machine, in one command (~1-2 minutes once the
control plane binaries are cached; the first run builds them, ~7-10 minutes).

1. ensure the local control plane binaries (hack/test-stack.sh ensure), start etcd +
   kube-apiserver + kube-controller-manager and the node simulator (FakeKubelet);
2. install the Helm chart (operator Deployment scaled to 0: the operator runs here as a local
   ``kopf run`` process with the chart's operator ServiceAccount token);
3. apply examples/demo-kvtransfer.yaml; start a prefill and a decode pod (real Pod objects,
   each backed by an agent process with real memory and real NIXL, using a pod-bound token);
4. show the pairing and the preflight handshakes, run a grouped + mixed-memory pull with
   byte-exact verification and its throughput;
5. start an incompatible decode pod and show the operator refusing it, with the reason;
6. print ``kubectl get kvtransfers,kvendpoints``; clean everything up (also on Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack"), str(REPO / "demo"), str(REPO / "agent"),
                str(REPO / "operator")]
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

import kvbridge_cluster as kc  # noqa: E402

NS, SYS_NS, RELEASE = "kvbridge-demo", "kvbridge-system", "kvbridge"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def ensure_stack() -> kc.Binaries:
    try:
        return kc.Binaries.find()
    except kc.StackMissingError:
        say("control plane binaries missing: building kube-apiserver/controller-manager "
            "v1.20.2 once from Debian's source (~7-10 minutes on 2 cores; cached in "
            "/var/cache/kvbridge) ...")
        env = {**os.environ, "PYTHON": sys.executable}
        subprocess.run(["bash", str(REPO / "hack" / "test-stack.sh"), "ensure"], check=True,
                       env=env)
        return kc.Binaries.find()


def main() -> int:
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cleanup: list = []
    try:
        return run(cleanup)
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception as exc:
                print(f"cleanup: {exc}", file=sys.stderr)
        say("cleaned up (agents, operator, control plane)")


def run(cleanup: list) -> int:
    from kubernetes import client
    from sim import SimPod, handshakes_ok, wait_until

    binaries = ensure_stack()
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

    say("starting the operator (kopf run, chart's operator ServiceAccount token) ...")
    token = k("create", "token", RELEASE, "-n", SYS_NS, "--duration=3600s").stdout.strip()
    kubeconfig = cluster.kubeconfig_for_token(token, "operator")
    liveness = kc.free_port()
    log = open(Path(cluster.workdir) / "operator.log", "wb")   # noqa: SIM115
    op = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--all-namespaces",
         f"--liveness=http://127.0.0.1:{liveness}/healthz", "-m", "kvbridge_operator.main"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "KUBECONFIG": str(kubeconfig), "KVBRIDGE_PEERING": "",
             "KVBRIDGE_METRICS_PORT": str(kc.free_port()), "KVBRIDGE_METRICS_ADDR": "127.0.0.1",
             "KVBRIDGE_DEBOUNCE": "0.1",
             "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'agent'}"})

    def stop_op() -> None:
        if op.poll() is None:
            op.terminate()
            try:
                op.wait(timeout=15)
            except subprocess.TimeoutExpired:
                op.kill()
        log.close()

    cleanup.append(stop_op)
    k("apply", "-n", NS, "-f", str(REPO / "examples" / "demo-kvtransfer.yaml"))
    say("applied examples/demo-kvtransfer.yaml (KVTransfer kvt)")

    sa = f"{RELEASE}-agent"
    pods: list[SimPod] = []
    cleanup.append(lambda: [p.close() for p in pods])
    p = SimPod(cluster, NS, "prefill-0", role="prefill", engine_id="prefill-engine", seed=42,
               sa=sa)
    d = SimPod(cluster, NS, "decode-0", role="decode", engine_id="decode-engine",
               preset="mixed", sa=sa)
    for pod in (p, d):
        pods.append(pod)
        ready = pod.start()
        say(f"pod {pod.name} Running; agent pid {ready['pid']} epoch {ready['epoch']} "
            f"side channel 127.0.0.1:{ready['port']} ({pod.preset} regions)")

    wait_until(lambda: handshakes_ok(d) and handshakes_ok(p), timeout=90,
               what="preflight handshakes")
    custom = client.CustomObjectsApi(cluster.api_client())
    for name in ("decode-0", "prefill-0"):
        st = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvendpoints",
                                                 name)["status"]
        hs = ", ".join(f"{h['peer']}@{h['epoch']}={h['state']}" for h in st["handshakes"])
        say(f"{name}: operator state {st['state']} peers "
            f"{[x['name'] for x in st['peers']]}; agent preflight: {hs}")

    def ready_cond() -> dict:
        t = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvtransfers",
                                                "kvt")
        return next((c for c in (t.get("status") or {}).get("conditions", [])
                     if c["type"] == "Ready" and c["status"] == "True"), {})

    cond = wait_until(ready_cond, timeout=60, what="KVTransfer Ready")
    say(f"KVTransfer kvt Ready: {cond['message']}")

    n = 64   # every block of both groups: 4 regions x 64 x 16 KiB, one region a DRAM pool
    local = [list(range(n)), list(range(n))]
    remote = [list(reversed(range(n))), list(range(n))]
    rates = []
    for i in range(5):
        rid = f"demo-{i}"
        p.call("hold", request_ids=[rid])
        d.call("clear")
        res = d.call("pull", request_id=rid, remote_engine_id="prefill-engine",
                     local_block_ids=local, remote_block_ids=remote, verify_seed=42)
        if not (res["ok"] and res["verified"]):
            say(f"transfer {rid} FAILED: {res}")
            return 1
        wait_until(lambda rid=rid: rid in p.call("completions")["finished"], timeout=10,
                   what=f"{rid} completion at the prefill")
        rates.append(res["gbps"])
    say(f"grouped + mixed-memory pull: {res['nbytes'] / 2**20:.1f} MiB, {res['descs']} "
        f"descriptors in {res['parts']} parts (VRAM<-VRAM and DRAM<-VRAM), byte-exact; "
        f"median {statistics.median(rates):.2f} GB/s over {len(rates)} requests; "
        "prefill got every completion notification")

    bad = SimPod(cluster, NS, "decode-bad", role="decode", engine_id="decode-bad",
                 preset="bad-block", sa=sa)
    pods.append(bad)
    bad.start()
    say("started decode-bad (block length 8 KiB instead of 16 KiB) ...")

    def refused() -> dict:
        st = custom.get_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints", "decode-bad").get("status") or {}
        return st if st.get("state") == "Incompatible" else {}

    st = wait_until(refused, timeout=60, what="decode-bad refused")
    say(f"decode-bad refused: {st['reason']}: {st['message'][:300]}")

    print(k("get", "kvtransfers,kvendpoints", "-n", NS, "-o", "wide").stdout, flush=True)
    say("demo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
