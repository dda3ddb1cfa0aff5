"""What every stage shares: the demo's namespaces and release, its clock and printer, the
control-plane binaries, and the :class:`Stage` a setup hands to the flow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge_testkit import cluster as kc

#: The repository: the chart, the example manifests and hack/'s scripts are read from here.
REPO = Path(__file__).resolve().parents[2]
NS, SYS_NS, RELEASE = "kvbridge-demo", "kvbridge-system", "kvbridge"
OPERATOR_METRICS_PORT = 9090    # the chart's metrics.port
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def ensure_stack() -> kc.Binaries:
    """The control plane and node binaries (a second when cached; ~8 minutes the first time)."""
    if not os.environ.get("KVB_KUBE_APISERVER"):
        say("ensuring the control plane and node binaries (hack/test-stack.sh ensure; the "
            "first run builds Kubernetes v1.20.2 from Debian's source, ~8 minutes) ...")
        env = {**os.environ, "PYTHON": sys.executable}
        subprocess.run(["bash", str(REPO / "hack" / "test-stack.sh"), "ensure"], check=True,
                       env=env, stdout=subprocess.DEVNULL)
    return kc.Binaries.find()


#: start_pod(name, role, engine_id, preset, seed, zone) -> (a pod handle with call/status,
#: where); zone None: wherever the scheduler puts it (on real nodes: the first node)
StartPod = Callable[[str, str, str, str, int, str | None], tuple[Any, str]]


@dataclass
class Stage:
    """Where the demo runs: the control plane, how a serving pod starts and goes, where the
    operator's metrics are, and (on a real node) vLLM serving pods."""

    cluster: kc.LocalCluster
    start_pod: StartPod
    #: host:port of the operator's metrics, where this machine's Prometheus scrapes them
    operator_metrics: str = ""
    #: stop a serving pod's agent and delete its Pod (name, the start_pod handle)
    delete_pod: Callable[[str, Any], None] = lambda name, handle: None
    #: vLLM serving pods answering a completion over a verified pair (a real node only)
    serve_vllm: Callable[[], None] | None = None
