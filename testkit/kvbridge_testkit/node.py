"""Real Kubernetes nodes on this machine: containerd, kubelet and kube-proxy v1.20.2.

Each node lives in a network namespace of its own, joined to the host by one veth pair, so
everything it changes in the network stack (the CNI bridge and pod veths, kube-proxy's and the
kubelet's iptables chains, ``ip_forward``, ``route_localnet``) exists only there and goes away
with the namespace. The host gains a route to each node's pods (node i holds 10.88.i.0/24) and
one to the Service range (via the first node), and keeps its sysctls: the kubelet is built not
to rewrite kernel tunables (hack/test-stack.sh) and kube-proxy is told not to touch conntrack
limits. Only loopback-like addresses on this machine are used: pods, Services and the links
live in ranges that exist nowhere else.

Two nodes are joined by :func:`connect`: a direct veth between their namespaces and a route to
each other's pods, so one pod network spans both and the host, which does not forward, is not
on the path. Each node's daemons run in a mount namespace of its own (its pod log directories,
its volume and root filesystem mounts), under a cgroup parent and a state directory of its own.

The control plane is ``cluster.LocalCluster(real_nodes=True, address=HOST_IP)``: the
apiserver listens on the host end of the first node's link, which every node's pods reach
through their node's default route, and it reaches webhooks through Service IPs routed into
the first node, where kube-proxy translates them (with ``--masquerade-all``, so replies return
through the node without the host's ``br_netfilter``).

Usage (the links come first: the apiserver binds the first one's host end)::

    node = RealNode(images=[...]).link_up()
    second = RealNode(images=[...], index=1).link_up()
    try:
        with LocalCluster(real_nodes=True, address=HOST_IP, service_cidr=SERVICE_CIDR) as c:
            start_all([node, second], c)  # and connect() them
            ...  # pods scheduled onto node.name or second.name run as real containers
            stop_all([node, second])  # the first last: it holds the apiserver's address
    finally:
        stop_all([node, second])  # idempotent; also removes the links if no cluster came up

containerd's content store and snapshots are kept in the cache (``RealNode.containerd_root``,
one per node) so a node starts in seconds when the images did not change; its state (tasks,
mounts, sockets) lives in ``NodeNet.run_dir`` and goes with the node.

``RealNode.stop`` cordons the node and deletes every pod first (so the kubelet tears sandboxes
down through CNI), stops the daemons, then removes what is left: shims, mounts, cgroups,
network namespaces, the link and the routes. ``leftovers()`` reports anything that survived;
tests assert on it. A run killed before its teardown (a cut-off CI job) leaves those behind:
the next ``link_up`` of the same node clears them, and refuses instead while any process still
lives in the node's namespace or in one of its containerd shims.

Binaries: kubelet and kube-proxy from ``hack/test-stack.sh ensure``; containerd, runc, CNI
plugins and ``ctr`` from Debian (installed by the same script).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge_testkit import HACK
from kvbridge_testkit.cluster import (
    CACHE,
    ENSURE_HINT,
    KUBE_VERSION,
    LocalCluster,
    StackMissingError,
    terminate,
)

log = logging.getLogger("kvbridge.node")

LINK_PREFIX = 30
#: The pod network of every node: node i takes 10.88.i.0/24 of it.
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
BRIDGE = "kvb0"
PAUSE_IMAGE = "registry.k8s.io/pause:3.6"
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Fixed paths in kubelet 1.20, which deletes every pod directory there it does not know: each
#: node mounts directories of its own over them in its mount namespace.
POD_LOGS = Path("/var/log/pods")
CONTAINER_LOGS = Path("/var/log/containers")


@dataclass(frozen=True)
class NodeNet:
    """Names and addresses of node ``index`` (0 is the first): its network namespace, its
    link to the host, its share of the pod network and its state directory. Everything is
    derived from the index, so two nodes never collide and a crashed run's remains are found
    by the same names."""

    index: int

    @property
    def name(self) -> str:
        return "kvb-node" if self.index == 0 else f"kvb-node-{self.index + 1}"

    @property
    def netns(self) -> str:
        return self.name

    @property
    def host_veth(self) -> str:
        return f"kvbh{self.index}"

    @property
    def node_veth(self) -> str:
        return f"kvbn{self.index}"

    @property
    def host_ip(self) -> str:
        return f"10.87.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.87.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.88.{self.index}.0/24"

    @property
    def run_dir(self) -> Path:
        return Path("/run") / self.name  # short: unix socket paths are limited to 108 bytes

    @property
    def cgroup_parent(self) -> str:
        """The kubelet's ``--cgroup-root``: each node's pods under a tree of its own."""
        return "/" if self.index == 0 else f"/{self.name}"

    @property
    def translates_host_services(self) -> bool:
        """The host routes the Service range to the first node, whose kube-proxy translates it
        (one route per range: the host does not forward, so one node answers for all)."""
        return self.index == 0


FIRST = NodeNet(0)
#: The first node: the apiserver binds its host end, which every node reaches by its own link.
HOST_IP, NODE_IP = FIRST.host_ip, FIRST.node_ip
NODE_NAME = NETNS = FIRST.name
HOST_VETH, NODE_VETH = FIRST.host_veth, FIRST.node_veth
RUN_DIR = FIRST.run_dir


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


class NodeError(RuntimeError):
    """The node could not be started or torn down; the message names the step and its log."""


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


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout)


def _stale_pod_netns() -> list[str]:
    """Pod network namespaces (CNI names them ``cni-<uuid>``) that no process uses any more."""
    netns_dir = Path("/run/netns")
    names = sorted(n for n in os.listdir(netns_dir) if n.startswith("cni-")) \
        if netns_dir.is_dir() else []
    return [n for n in names if not _sh("ip", "netns", "pids", n, check=False).stdout.split()]


def _remove_netns_file(name: str) -> None:
    path = Path("/run/netns") / name
    _sh("umount", "-l", str(path), check=False)
    with contextlib.suppress(OSError):
        path.unlink()


def host_rules() -> list[str]:
    """The host's iptables rules and chains (comments and counters dropped): the node's live in
    its own network namespace, so these must not change."""
    out = _sh("iptables-save").stdout.splitlines()
    return [line.split(" [", 1)[0] for line in out if not line.startswith("#")]


#: Host settings a kubelet or kube-proxy would rewrite by default; the node must leave them be.
WATCHED_SYSCTLS = ("kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory",
                   "vm/panic_on_oom", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
                   "net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet",
                   "net/netfilter/nf_conntrack_max")  # fmt: skip


def host_sysctls() -> dict[str, str]:
    out = {}
    for name in WATCHED_SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = (Path("/proc/sys") / name).read_text().strip()
    return out


def containerd_config(root: Path, state: Path, socket: Path, cni_conf: Path, cni_bin: Path) -> str:
    """containerd 1.6 settings found by failures on these machines (shared/notes/real-node.md):
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


@dataclass
class RealNode:
    """A kubelet node registered with ``cluster``; see the module docstring."""

    images: list[Path] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    #: ``key=value:Effect`` taints the kubelet registers the node with.
    taints: list[str] = field(default_factory=list)
    binaries: NodeBinaries = field(default_factory=NodeBinaries.find)
    workdir: Path | None = None
    #: Which node of the cluster this is (0 is the first): names and addresses follow from it.
    index: int = 0
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _made_dirs: list[Path] = field(default_factory=list, repr=False)
    _netns_before: set[str] = field(default_factory=set, repr=False)
    _host_rules_before: list[str] = field(default_factory=list, repr=False)
    _sysctls_before: dict[str, str] = field(default_factory=dict, repr=False)

    cluster: LocalCluster | None = field(default=None, repr=False)
    service_cidr: str = SERVICE_CIDR
    #: containerd's content store and snapshots, one per node: kept between runs, so unchanged
    #: images are not unpacked again (its state, with every running task, lives in run_dir).
    containerd_root: Path | None = None

    def __post_init__(self) -> None:
        self.net = NodeNet(self.index)
        self.name = self.net.name
        if self.containerd_root is None:
            store = "containerd" if self.index == 0 else f"containerd-{self.name}"
            self.containerd_root = CACHE / "node" / store
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}.", dir="/var/tmp"))
        self.socket = self.net.run_dir / "containerd.sock"
        self.mount_ns = self.net.run_dir / "mnt"

    def _in_node(self, *cmd: str) -> list[str]:
        """``cmd`` run in the node's network and mount namespaces (``ip netns exec`` would also
        remount /sys, hiding the cgroup hierarchies the kubelet and runc need)."""
        return ["nsenter", f"--net=/run/netns/{self.net.netns}", f"--mount={self.mount_ns}",
                "--", *cmd]  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------
    def link_up(self) -> RealNode:
        """The node's network namespace and its link to the host (before the apiserver starts:
        it binds HOST_IP)."""
        self._clear_crashed_run()
        self._netns_before = set(os.listdir("/run/netns")) if Path("/run/netns").is_dir() else set()
        self._host_rules_before = host_rules()
        self._sysctls_before = host_sysctls()
        try:
            self._link_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _clear_crashed_run(self) -> None:
        """Remove what a node killed without its teardown left (its link, routes, mounts,
        network namespaces, cgroups), so one crashed run does not fail every later one; refuse
        while any process of another node still runs here."""
        netns, run_dir = self.net.netns, self.net.run_dir
        if not Path(f"/run/netns/{netns}").exists() and not run_dir.exists():
            return
        alive = self._other_node_processes()
        if alive:
            raise NodeError(f"another node runs here: processes {alive} live in network "
                            f"namespace {netns} or in containerd shims of {run_dir}; stop that "
                            f"run first")
        stale_netns = _stale_pod_netns()
        log.warning("clearing what a crashed node run left: netns %s, %s",
                    [netns, *stale_netns], run_dir)  # fmt: skip
        stale_workdirs = [d for d in Path("/var/tmp").glob(f"{self.name}.*") if d != self.workdir]
        self._unmount_under(run_dir, *stale_workdirs)
        for name in stale_netns:
            _remove_netns_file(name)
        self._remove_cgroups()
        self._remove_link()
        shutil.rmtree(run_dir, ignore_errors=True)
        for workdir in stale_workdirs:
            shutil.rmtree(workdir, ignore_errors=True)

    def _other_node_processes(self) -> list[int]:
        in_netns = _sh("ip", "netns", "pids", self.net.netns, check=False).stdout.split()
        return sorted({int(pid) for pid in in_netns} | set(self._shim_pids()))

    def start(self, cluster: LocalCluster, timeout: float = 120.0) -> RealNode:
        """Run containerd, the kubelet and kube-proxy against ``cluster`` until Ready."""
        if cluster.address != HOST_IP or not cluster.real_nodes:
            raise NodeError(f"the cluster must run with real_nodes=True and address={HOST_IP}")
        if cluster.service_cidr != self.service_cidr:
            raise NodeError(f"the cluster's Service range {cluster.service_cidr} is not the "
                            f"node's {self.service_cidr}")
        self.cluster = cluster
        try:
            self._mount_namespace_up()
            self._start_containerd()
            self._import_images()
            self._start_kubelet()
            self._start_proxy()
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _link_up(self) -> None:
        n = self.net
        _sh("ip", "netns", "add", n.netns)
        _sh("ip", "link", "add", n.host_veth, "type", "veth", "peer", "name", n.node_veth,
            "netns", n.netns)  # fmt: skip
        _sh("ip", "addr", "add", f"{n.host_ip}/{LINK_PREFIX}", "dev", n.host_veth)
        _sh("ip", "link", "set", n.host_veth, "up")
        node = ["ip", "netns", "exec", n.netns]
        _sh(*node, "ip", "addr", "add", f"{n.node_ip}/{LINK_PREFIX}", "dev", n.node_veth)
        _sh(*node, "ip", "link", "set", n.node_veth, "up")
        _sh(*node, "ip", "link", "set", "lo", "up")
        # Every node reaches the apiserver (HOST_IP) through its own link: the host delivers
        # what is addressed to it whichever link it came in on.
        _sh(*node, "ip", "route", "add", "default", "via", n.host_ip)
        # A Service address kube-proxy has not translated (yet) fails at once instead of
        # looping between host and node until its TTL runs out.
        _sh(*node, "ip", "route", "add", "unreachable", self.service_cidr)
        # Per-namespace: forwarding between pods, Services and the link happens in the node.
        _sh(*node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for cidr in self._host_routes():
            _sh("ip", "route", "add", cidr, "via", n.node_ip, "dev", n.host_veth)

    def _host_routes(self) -> list[str]:
        """What the host routes into this node: its pods, and the Service range if it is the
        node that translates the host's Service traffic."""
        return [self.net.pod_cidr, *([self.service_cidr] if self.net.translates_host_services
                                     else [])]  # fmt: skip

    def _mount_namespace_up(self) -> None:
        """A mount namespace of the node's own, where its kubelet and containerd run: it holds
        the node's own pod log directories (kubelet 1.20 deletes every directory under its
        fixed /var/log/pods that it does not know, another node's included) and every mount
        they make (volumes, container root filesystems), which go with it. /run/netns stays
        shared with the host, so pods' network namespaces are visible there as on any node."""
        assert self.workdir is not None
        run_dir = self.net.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        # A namespace file can only be bound onto a mount that does not propagate.
        _sh("mount", "--bind", str(run_dir), str(run_dir))
        _sh("mount", "--make-private", str(run_dir))
        self.mount_ns.touch()
        binds = []
        for shared, own in ((POD_LOGS, self.workdir / "pod-logs"),
                            (CONTAINER_LOGS, self.workdir / "container-logs")):  # fmt: skip
            own.mkdir(parents=True, exist_ok=True)
            if not shared.exists():
                shared.mkdir(parents=True)
                self._made_dirs.append(shared)
            binds.append(f"mount --bind {shlex.quote(str(own))} {shlex.quote(str(shared))}")
        _sh("unshare", f"--mount={self.mount_ns}", "--propagation", "unchanged", "--",
            "sh", "-c", " && ".join(binds))  # fmt: skip

    def _make_cgroup_parent(self) -> None:
        """The kubelet's ``--cgroup-root`` must exist in every hierarchy; cpuset needs its CPUs
        and memory nodes before anything can join it."""
        parent = self.net.cgroup_parent.strip("/")
        if not parent:
            return
        for hierarchy in sorted(CGROUP_ROOT.iterdir()):
            if not (hierarchy / "cgroup.procs").exists():
                continue
            own = hierarchy / parent
            own.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (own / name).exists() and not (own / name).read_text().strip():
                    (own / name).write_text((hierarchy / name).read_text())

    def stop_kubelet(self) -> None:
        """Stop the kubelet alone (its pods keep running in containerd): the node goes
        NotReady once the node controller's grace period passes, as on a real node whose
        kubelet died."""
        self._terminate("kubelet")

    def start_kubelet(self) -> None:
        """Start the kubelet again after :meth:`stop_kubelet`; it adopts the running pods."""
        if "kubelet" in self._procs:
            raise NodeError(f"the kubelet of {self.name} is running")
        self._start_kubelet()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        assert self.workdir is not None
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        out = open(self.log(name), "wb")  # noqa: SIM115 - owned by the child
        self._procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        out.close()

    def log(self, name: str) -> Path:
        assert self.workdir is not None
        return self.workdir / "logs" / f"{name}.log"

    def _start_containerd(self) -> None:
        assert self.workdir is not None
        cni_conf = self.workdir / "cni-conf"
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-kvbridge.conflist").write_text(
            json.dumps(cni_config(self.workdir / "cni-ipam", self.net.pod_cidr), indent=1))
        config = self.workdir / "containerd.toml"
        assert self.containerd_root is not None
        config.write_text(containerd_config(self.containerd_root, self.net.run_dir / "containerd",
                                            self.socket, cni_conf, self.binaries.cni_dir))
        self._spawn("containerd", self._in_node(str(self.binaries.containerd), "--config",
                                           str(config), "--log-level", "warn"))
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            self._check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"containerd did not answer on {self.socket}; see "
                                f"{self.log('containerd')}")
            time.sleep(0.2)

    def ctr(self, *args: str, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """``ctr`` against this node's containerd, in the Kubernetes namespace."""
        return _sh(str(self.binaries.ctr), "--address", str(self.socket), "-n", "k8s.io",
                   *args, check=check, timeout=timeout)  # fmt: skip

    def _import_images(self) -> None:
        # Containers a crashed run left in the kept store would come back as ghost sandboxes.
        for old in self.ctr("containers", "ls", "-q").stdout.split():
            self.ctr("containers", "rm", old, check=False)
        for archive in self.images:
            try:
                self.ctr("images", "import", str(archive), timeout=300)
            except subprocess.CalledProcessError as exc:
                raise NodeError(f"importing {archive} failed: {exc.stderr.strip()}") from exc

    def image_names(self) -> list[str]:
        return self.ctr("images", "ls", "-q").stdout.split()

    def tag(self, source: str, target: str) -> None:
        """Give an imported image a second name (a 'new tag' for upgrade tests)."""
        self.ctr("images", "tag", "--force", source, target)

    def _start_kubelet(self) -> None:
        assert self.workdir is not None and self.cluster is not None
        root = self.workdir / "kubelet"
        root.mkdir(exist_ok=True)
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("")  # pods resolve nothing outside this machine
        kubeconfig = self.cluster.kubeconfig
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self._make_cgroup_parent()
        self._spawn("kubelet", self._in_node(
            str(self.binaries.kubelet), f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}", f"--node-ip={self.net.node_ip}",
            f"--cgroup-root={self.net.cgroup_parent}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.socket}",
            "--cgroup-driver=cgroupfs", "--oom-score-adj=0", "--fail-swap-on=false",
            f"--root-dir={root}", f"--cert-dir={root / 'pki'}",
            f"--volume-plugin-dir={root / 'volume-plugins'}",
            f"--resolv-conf={resolv}", "--read-only-port=0",
            "--healthz-bind-address=127.0.0.1", f"--pod-infra-container-image={PAUSE_IMAGE}",
            # Images are imported, never pulled: keep them whatever the shared disk holds.
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
            "--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%",
            "--node-status-update-frequency=2s", "--sync-frequency=5s",
            "--runtime-request-timeout=2m", "--serialize-image-pulls=false",
            *([f"--node-labels={labels}"] if labels else []),
            *([f"--register-with-taints={','.join(self.taints)}"] if self.taints else []), "-v=1",
        ))  # fmt: skip

    def _start_proxy(self) -> None:
        assert self.cluster is not None
        self._spawn("kube-proxy", self._in_node(
            str(self.binaries.kube_proxy), f"--kubeconfig={self.cluster.kubeconfig}",
            f"--hostname-override={self.name}", "--proxy-mode=iptables",
            f"--cluster-cidr={POD_CIDR}", "--masquerade-all",
            # 0 = leave the (host-wide) conntrack table settings alone.
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", "--oom-score-adj=0",
            "--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256",
            "--iptables-min-sync-period=0s", "-v=1",
        ))  # fmt: skip

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                tail = self.log(name).read_text(errors="replace")[-2000:]
                raise NodeError(f"{name} exited with {proc.returncode}; see {self.log(name)}:\n"
                                f"{tail}")

    def _wait_ready(self, deadline: float) -> None:
        from kubernetes import client

        assert self.cluster is not None
        core = client.CoreV1Api(self.cluster.api_client())
        last = "not registered"
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(client.ApiException):
                node = core.read_node(self.name)
                ready = [c for c in node.status.conditions or [] if c.type == "Ready"]
                if ready and ready[0].status == "True":
                    return
                last = ready[0].message if ready else "no Ready condition"
            time.sleep(0.5)
        raise NodeError(f"node {self.name} not Ready: {last}; see {self.log('kubelet')}")

    # -- teardown ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Delete pods, stop the daemons, remove everything the node made (idempotent)."""
        steps: list[tuple[str, Any]] = [
            ("drain", self._drain_if_running),
            ("daemons", lambda: [self._terminate(n) for n in ("kube-proxy", "kubelet")]),
            ("tasks", self._remove_tasks),
            ("containerd", lambda: self._terminate("containerd")),
            ("shims", self._kill_shims),
            ("mounts", lambda: self._unmount_under(self.net.run_dir,
                                                   *filter(None, [self.workdir]))),
            ("cgroups", self._remove_cgroups),
            ("netns", self._remove_pod_netns),
            ("link", self._remove_link),
            ("dirs", self._remove_made_dirs),
        ]
        for name, step in steps:
            start = time.monotonic()
            try:
                step()
            except Exception as exc:  # keep going: every later step removes something else
                log.warning("node teardown step %s failed: %s", name, exc)
            log.debug("node teardown step %s took %.1f s", name, time.monotonic() - start)
        shutil.rmtree(self.net.run_dir, ignore_errors=True)
        if self.workdir is not None and not os.environ.get("KVB_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _drain_if_running(self) -> None:
        if "kubelet" not in self._procs or self._procs["kubelet"].poll() is not None:
            return
        assert self.cluster is not None
        if not _sh("ip", "-o", "addr", "show", "to", self.cluster.address).stdout.strip():
            # The first node stopped before this one and took the apiserver's address with its
            # link: a call now would leave the machine by its default route. Its pods go with
            # the tasks, the shims and the namespaces below.
            log.warning("not draining %s: the apiserver's address %s is gone (stop the first "
                        "node last)", self.name, self.cluster.address)  # fmt: skip
            return
        self._drain(time.monotonic() + 60)

    def _drain(self, deadline: float) -> None:
        """Cordon the node, delete every pod bound to it and wait until containerd runs no
        sandbox, so the kubelet tears each down through CNI (address released, veth gone)."""
        from kubernetes import client

        assert self.cluster is not None
        core = client.CoreV1Api(self.cluster.api_client())
        # Cordon first: a Deployment's replacement pods must not land here while it drains.
        core.patch_node(self.name, {"spec": {"unschedulable": True}})
        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}")
        for pod in pods.items:
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                           grace_period_seconds=0)
        while time.monotonic() < deadline:
            if not self.running_tasks():
                return
            time.sleep(0.5)

    def running_tasks(self) -> list[str]:
        """Container and sandbox tasks containerd runs now (stopped ones left out)."""
        rows = self.ctr("tasks", "ls", check=False, timeout=20).stdout.splitlines()[1:]
        return [r.split()[0] for r in rows if r.split()[2:3] == ["RUNNING"]]

    def _terminate(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None:
            terminate(proc, timeout=15)

    def _remove_tasks(self) -> None:
        if "containerd" not in self._procs:
            return
        for task in self.ctr("tasks", "ls", "-q", check=False, timeout=20).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=20)
        time.sleep(0.5)
        for task in self.ctr("tasks", "ls", "-q", check=False, timeout=20).stdout.split():
            self.ctr("tasks", "delete", "--force", task, check=False, timeout=20)

    def _shim_pids(self) -> list[int]:
        marker = str(self.socket).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and marker in cmdline:
                    pids.append(int(entry.name))
        return pids

    def _kill_shims(self) -> None:
        for pid in self._shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)

    @staticmethod
    def _mounts_under(*roots: Path) -> list[str]:
        prefixes = tuple(str(r).rstrip("/") + "/" for r in roots)
        points = []
        with open("/proc/self/mounts") as f:
            for line in f:
                point = line.split()[1].encode().decode("unicode_escape")
                if point.startswith(prefixes) or point in {p.rstrip("/") for p in prefixes}:
                    points.append(point)
        return points

    def _unmount_under(self, *roots: Path) -> None:
        for point in sorted(self._mounts_under(*roots), key=len, reverse=True):
            _sh("umount", "-l", point, check=False)

    def _kubepods_cgroups(self) -> list[Path]:
        """The node's pod cgroup trees (for a node with a parent of its own, that parent)."""
        top = self.net.cgroup_parent.strip("/") or "kubepods"
        return [d for d in CGROUP_ROOT.glob(f"*/{top}") if d.is_dir()]

    def _remove_cgroups(self) -> None:
        for top in self._kubepods_cgroups():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()

    def _new_netns(self) -> list[str]:
        now = set(os.listdir("/run/netns")) if Path("/run/netns").is_dir() else set()
        return sorted(now - self._netns_before)

    def _remove_pod_netns(self) -> None:
        """Pod namespaces made since this node came up that no process uses any more (another
        node's running pods keep theirs)."""
        stale = set(_stale_pod_netns())
        for name in self._new_netns():
            if name in stale:
                _remove_netns_file(name)

    def _remove_link(self) -> None:
        n = self.net
        for cidr in self._host_routes():
            _sh("ip", "route", "del", cidr, "via", n.node_ip, check=False)
        _sh("ip", "link", "del", n.host_veth, check=False)
        _sh("ip", "netns", "del", n.netns, check=False)

    def _remove_made_dirs(self) -> None:
        for path in self._made_dirs:
            with contextlib.suppress(OSError):
                path.rmdir()
        self._made_dirs.clear()

    def leftovers(self) -> dict[str, list[str]]:
        """What a stopped node left on the host, by kind; empty lists when clean."""
        links = _sh("ip", "-o", "link", "show").stdout
        sysctls = host_sysctls()
        routes = _sh("ip", "route", "show").stdout
        return {
            "links": re.findall(rf"^\d+: ({self.net.host_veth}|{BRIDGE}|veth\w+)[@:]", links,
                                re.M),
            "routes": [r for r in routes.splitlines() if f"via {self.net.node_ip} " in r],
            "netns": self._new_netns(),
            "mounts": self._mounts_under(self.net.run_dir,
                                         *([self.workdir] if self.workdir else [])),
            "cgroups": [str(p) for p in self._kubepods_cgroups()],
            "shims": [str(p) for p in self._shim_pids()],
            "daemons": [n for n, p in self._procs.items() if p.poll() is None],
            "host_iptables": sorted(set(host_rules()) ^ set(self._host_rules_before)),
            "host_sysctls": [f"{k}: {v} -> {sysctls.get(k)}"
                             for k, v in self._sysctls_before.items() if sysctls.get(k) != v],
        }


def start_all(nodes: Sequence[RealNode], cluster: LocalCluster) -> None:
    """Start every node (links up) against ``cluster`` and :func:`connect` each pair."""
    for node in nodes:
        node.start(cluster)
    for i, first in enumerate(nodes):
        for second in nodes[i + 1:]:
            connect(first, second)


def stop_all(nodes: Sequence[RealNode]) -> None:
    """Stop every node, the first one last: its link carries the apiserver's address, which
    the others need to drain (idempotent, as ``RealNode.stop``)."""
    for node in sorted(nodes, key=lambda n: n.index, reverse=True):
        node.stop()


def connect(a: RealNode, b: RealNode) -> None:
    """A direct link between two nodes' network namespaces and a route to each other's pods:
    one pod network over both nodes. The host does not forward (its ``ip_forward`` stays as it
    is), so node-to-node traffic never passes through it; the link goes with either namespace."""
    first, second = sorted((a, b), key=lambda n: n.index)
    i, j = first.index, second.index
    net = f"10.87.{200 + i}"  # one /30 per pair of nodes
    ends = [(first, f"kvbp{j}", f"{net}.{4 * j + 1}"), (second, f"kvbp{i}", f"{net}.{4 * j + 2}")]
    _sh("ip", "-n", first.net.netns, "link", "add", ends[0][1], "type", "veth", "peer",
        "name", ends[1][1], "netns", second.net.netns)  # fmt: skip
    for node, dev, addr in ends:
        _sh("ip", "-n", node.net.netns, "addr", "add", f"{addr}/{LINK_PREFIX}", "dev", dev)
        _sh("ip", "-n", node.net.netns, "link", "set", dev, "up")
    for (node, _, _), (other, _, other_addr) in (ends, ends[::-1]):
        _sh("ip", "-n", node.net.netns, "route", "add", other.net.pod_cidr, "via", other_addr)
