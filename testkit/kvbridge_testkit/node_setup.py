"""What a real node (:mod:`kvbridge_testkit.node`) runs and is configured with: its images
(the archives of hack/node-images.sh), its binaries (hack/test-stack.sh) and the files its
containerd and CNI read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge_testkit import HACK
from kvbridge_testkit.node_net import BRIDGE
from kvbridge_testkit.stack import CACHE, ENSURE_HINT, KUBE_VERSION, StackMissingError

PAUSE_IMAGE = "registry.k8s.io/pause:3.6"
IMAGES_SCRIPT = HACK / "node-images.sh"


class ImagesMissingError(RuntimeError):
    """The image archives are not built (or stale); the message says how to build them."""


def node_images(build: bool = False) -> dict[str, str]:
    """``KVB_IMAGE_*`` of hack/node-images.sh: archive paths and image names. Missing or stale
    archives are built when ``build`` (about 3 minutes the first time), else an error."""
    check = subprocess.run(["bash", str(IMAGES_SCRIPT), "check"], capture_output=True,
                           text=True)  # fmt: skip
    if check.returncode != 0:
        if not build:
            raise ImagesMissingError(
                f"node images missing or stale: run `bash {IMAGES_SCRIPT} ensure` (about 3 "
                f"minutes the first time, then cached). {check.stderr.strip()}"
            )
        subprocess.run(["bash", str(IMAGES_SCRIPT), "ensure"], check=True)
    out = subprocess.run(["bash", str(IMAGES_SCRIPT), "paths"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return dict(line.split("=", 1) for line in out.split() if "=" in line)


def image_archives(images: dict[str, str]) -> list[Path]:
    """The archives a node imports: the sandbox image first, then the operator, the agent,
    the vLLM serving image and the demo gateway's Envoy."""
    return [Path(images[k]) for k in ("KVB_IMAGE_PAUSE_TAR", "KVB_IMAGE_OPERATOR_TAR",
                                      "KVB_IMAGE_AGENT_TAR", "KVB_IMAGE_VLLM_TAR",
                                      "KVB_IMAGE_ENVOY_TAR")]  # fmt: skip


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    containerd: Path
    ctr: Path
    runc: Path
    cni_dir: Path

    @classmethod
    def find(cls) -> NodeBinaries:
        kube = CACHE / f"kube-{KUBE_VERSION}"
        paths = {
            "kubelet": Path(os.environ.get("KVB_KUBELET") or kube / "kubelet"),
            "kube_proxy": Path(os.environ.get("KVB_KUBE_PROXY") or kube / "kube-proxy"),
            "containerd": Path(shutil.which("containerd") or "/usr/bin/containerd"),
            "ctr": Path(shutil.which("ctr") or "/usr/bin/ctr"),
            "runc": Path(shutil.which("runc") or "/usr/sbin/runc"),
            "cni_dir": Path("/usr/lib/cni"),
        }
        missing = [f"{k}={p}" for k, p in paths.items() if not p.exists()]
        if not (paths["cni_dir"] / "bridge").exists():
            missing.append(f"cni bridge plugin in {paths['cni_dir']}")
        if missing:
            raise StackMissingError(f"node binaries missing ({', '.join(missing)}): {ENSURE_HINT}")
        return cls(**paths)


def containerd_config(root: Path, state: Path, socket: Path, cni_conf: Path, cni_bin: Path) -> str:
    """containerd 1.6 settings found by failures on these machines (docs/platform/real-node.md):
    no negative oom_score_adj, no hugetlb controller, cgroupfs (no systemd); runc keeps its
    state under the node's own directory (not the shared /run/containerd/runc)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  disable_apparmor = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{state}/runc"
  [{cri}.cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""


def cni_config(ipam_dir: Path, pod_cidr: str) -> dict[str, Any]:
    """A bridge network with host-local addresses; no masquerade: nothing leaves the machine."""
    return {
        "cniVersion": "0.4.0",
        "name": "kvbridge",
        "plugins": [
            {
                "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                         "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]},
            },
        ],
    }  # fmt: skip
