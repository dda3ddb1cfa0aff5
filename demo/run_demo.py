"""`make demo`: kvbridge end to end on this machine, in one command.

On a machine that can run one (root, cgroup v1, network namespaces), everything runs as it
would for a user: two real kubelet nodes in two zones on one pod network
(kvbridge_testkit.node) run the operator from the chart, unmodified, and the serving pods from
images built here (hack/node-images.sh). Where the nodes cannot start, the demo says why and
falls back to simulated pods: real Pod objects on a node simulator, each backed by an agent
process (kvbridge_testkit.sim), with the operator as a local ``kopf run``.
``KVBRIDGE_DEMO=simulated`` (or ``node``) chooses explicitly.

1. ensure the binaries (hack/test-stack.sh ensure; the first run builds them, ~8 minutes, and
   on a real node the images, ~3 minutes), start etcd + kube-apiserver +
   kube-controller-manager (+ kube-scheduler, kubelet, kube-proxy and containerd);
2. install the Helm chart (real node: the operator Deployment from the local image, its
   webhook behind its Service; simulated: the operator as a local process with the chart's
   ServiceAccount token and a loopback webhook);
3. apply examples/demo-kvtransfer.yaml; start a prefill and a decode pod (real containers, the
   decode on the second node; or agent processes with real memory and real NIXL; pod-bound
   tokens either way);
4. show the pairing and the preflight handshakes, run a grouped + mixed-memory pull with
   byte-exact verification (across nodes, on real nodes), its throughput and the transport
   UCX chose;
5. show the admission webhook refusing a malformed KVEndpoint (tpRank >= tpSize) and a pod
   overwriting another pod's endpoint, with their messages;
6. start an incompatible decode pod and show the operator refusing it, with the reason;
7. print ``kubectl get pods`` and ``kubectl get kvtransfers,kvendpoints``; clean everything
   up (also on Ctrl-C).

With Prometheus installed (``make test-stack`` installs Debian's), a real Prometheus on this
machine (kvbridge_testkit.prometheus) scrapes the operator and the agents (on real nodes: the
pod IPs, which the host routes to each node) with the chart's alert rules: the demo prints its
scrape targets, and the KVBridgeTransferDegraded alert firing when the incompatible decode pod
joins and resolving when it is removed.

This script is the flow; each stage is a module of demo/stages/.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The checkout's agent and operator come first (this folder, with stages/, is sys.path[0]).
sys.path[:0] = [str(REPO / "agent"), str(REPO / "operator")]
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

from stages.admission import show_admission  # noqa: E402
from stages.alerts import scrape_agents, show_alert, show_targets, start_prometheus  # noqa: E402
from stages.common import NS, RELEASE, Stage, ensure_stack, say  # noqa: E402
from stages.real_nodes import setup_node  # noqa: E402
from stages.simulated import setup_simulated  # noqa: E402


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

    from kvbridge_testkit.sim import handshakes_ok, wait_until

    binaries = ensure_stack()
    mode = os.environ.get("KVBRIDGE_DEMO", "auto")
    if mode not in {"auto", "node", "simulated"}:
        raise SystemExit(f"KVBRIDGE_DEMO={mode!r}: expected auto, node or simulated")
    stage: Stage | None = None
    if mode != "simulated":
        try:
            stage = setup_node(binaries, cleanup)
        except Exception as exc:
            if mode == "node":
                raise
            say(f"a real node cannot run here ({type(exc).__name__}: {str(exc)[:300]}); "
                "falling back to simulated pods")
            for fn in reversed(cleanup):
                try:
                    fn()
                except Exception as cleanup_exc:
                    print(f"cleanup: {cleanup_exc}", file=sys.stderr)
            cleanup.clear()
    if stage is None:
        stage = setup_simulated(binaries, cleanup)
    cluster = stage.cluster
    prom = start_prometheus(stage, binaries, cleanup)
    started: dict[str, Any] = {}

    def start_pod(name: str, role: str, engine: str, preset: str, seed: int,
                  zone: str | None = None) -> tuple[Any, str]:  # fmt: skip
        handle, where = stage.start_pod(name, role, engine, preset, seed, zone)
        started[name] = handle
        if prom is not None:
            scrape_agents(prom, started)
        return handle, where

    k = cluster.kubectl
    k("apply", "-n", NS, "-f", str(REPO / "examples" / "demo-kvtransfer.yaml"))
    say("applied examples/demo-kvtransfer.yaml (KVTransfer kvt)")

    sa = f"{RELEASE}-agent"
    p, where = start_pod("prefill-0", "prefill", "prefill-engine", "grouped", 42)
    say(f"pod prefill-0 Running: {where} (grouped regions)")
    # On real nodes the decode runs on the second node (zone-b): its pulls cross the pod network.
    d, where = start_pod("decode-0", "decode", "decode-engine", "mixed", 0, "zone-b")
    say(f"pod decode-0 Running: {where} (mixed regions)")

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
    hs = custom.get_namespaced_custom_object("kvbridge.io", "v1alpha1", NS, "kvendpoints",
                                             "decode-0")["status"]["handshakes"]
    say("UCX reaches prefill-0 over " + ", ".join(
        f"{h.get('transport', '?')} ({h.get('transportDetail', '')})" for h in hs)
        + " (KVEndpoint decode-0 status.handshakes[].transport, as UCX selected it)")
    if prom is not None:
        show_targets(prom, 1 + len(started))

    show_admission(cluster, custom, sa)
    if stage.serve_vllm is not None:
        stage.serve_vllm()
    else:
        say("vLLM serving pods need the real node; skipped with simulated pods")

    start_pod("decode-bad", "decode", "decode-bad", "bad-block", 0)
    say("started decode-bad (block length 8 KiB instead of 16 KiB) ...")

    def refused() -> dict:
        st = custom.get_namespaced_custom_object(
            "kvbridge.io", "v1alpha1", NS, "kvendpoints", "decode-bad").get("status") or {}
        return st if st.get("state") == "Incompatible" else {}

    st = wait_until(refused, timeout=60, what="decode-bad refused")
    say(f"decode-bad refused: {st['reason']}: {st['message'][:300]}")
    if prom is not None:
        show_alert(prom, stage, started)

    print(k("get", "pods", "-A", "-o", "wide").stdout, flush=True)
    print(k("get", "kvtransfers,kvendpoints", "-n", NS, "-o", "wide").stdout, flush=True)
    say("demo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
