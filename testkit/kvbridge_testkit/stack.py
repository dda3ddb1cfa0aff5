"""The test stack's binaries (``hack/test-stack.sh ensure``): where they are, and the error
that says how to install them when they are not."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvbridge_testkit import HACK

KUBE_VERSION = "v1.20.2"
CACHE = Path(os.environ.get("KVB_CACHE", "/var/cache/kvbridge"))
ENSURE_HINT = (
    f"run `bash {HACK / 'test-stack.sh'} ensure` as root first (builds Kubernetes "
    f"{KUBE_VERSION}'s control plane, kubelet and kube-proxy once, ~8 minutes, installs the "
    f"node's containerd, and fetches kubectl/helm)"
)


class StackMissingError(RuntimeError):
    """A test-stack binary is missing; the message says how to install it."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    helm: Path
    kube_scheduler: Path | None = None

    @classmethod
    def find(cls) -> Binaries:
        """Locate the binaries (env overrides ``KVB_KUBE_APISERVER`` ...) or raise."""
        kube = CACHE / f"kube-{KUBE_VERSION}"
        candidates = {
            "etcd": os.environ.get("KVB_ETCD") or shutil.which("etcd") or "/usr/bin/etcd",
            "kube_apiserver": os.environ.get("KVB_KUBE_APISERVER") or kube / "kube-apiserver",
            "kube_controller_manager": os.environ.get("KVB_KUBE_CONTROLLER_MANAGER")
            or kube / "kube-controller-manager",
            "kubectl": os.environ.get("KVB_KUBECTL") or CACHE / "bin" / "kubectl",
            "helm": os.environ.get("KVB_HELM") or CACHE / "bin" / "helm",
        }
        paths = {k: Path(v) for k, v in candidates.items()}
        missing = [f"{k}={p}" for k, p in paths.items() if not os.access(p, os.X_OK)]
        if missing:
            raise StackMissingError(
                f"test stack binaries missing ({', '.join(missing)}): {ENSURE_HINT}"
            )
        scheduler = Path(os.environ.get("KVB_KUBE_SCHEDULER") or kube / "kube-scheduler")
        return cls(**paths, kube_scheduler=scheduler if os.access(scheduler, os.X_OK) else None)
