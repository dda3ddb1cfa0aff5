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

This module starts a node; :mod:`~kvbridge_testkit.node_net` names and addresses it (and
connects two), :mod:`~kvbridge_testkit.node_setup` finds its images and binaries and writes its
config files, :mod:`~kvbridge_testkit.node_teardown` stops it. Their public names are
importable from here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge_testkit.cluster import LocalCluster
from kvbridge_testkit.node_net import (
    CGROUP_ROOT,
    FIRST,
    HOST_IP,
    HOST_VETH,
    LINK_PREFIX,
    NETNS,
    NODE_IP,
    NODE_NAME,
    NODE_VETH,
    POD_CIDR,
    RUN_DIR,
    SERVICE_CIDR,
    NodeNet,
    connect,
    host_rules,
    host_sysctls,
    remove_netns_file,
    sh,
    stale_pod_netns,
)
from kvbridge_testkit.node_setup import (
    IMAGES_SCRIPT,
    PAUSE_IMAGE,
    ImagesMissingError,
    NodeBinaries,
    cni_config,
    containerd_config,
    image_archives,
    node_images,
)
from kvbridge_testkit.node_teardown import NodeTeardown
from kvbridge_testkit.stack import CACHE

# The names callers import from here; node_net, node_setup and node_teardown hold them.
__all__ = [
    "FIRST", "HOST_IP", "HOST_VETH", "IMAGES_SCRIPT", "LINK_PREFIX", "NETNS", "NODE_IP",
    "NODE_NAME", "NODE_VETH", "PAUSE_IMAGE", "POD_CIDR", "RUN_DIR", "SERVICE_CIDR",
    "ImagesMissingError", "NodeBinaries", "NodeError", "NodeNet", "RealNode", "connect",
    "image_archives", "node_images", "start_all", "stop_all",
]  # fmt: skip

log = logging.getLogger("kvbridge.node")

#: Fixed paths in kubelet 1.20, which deletes every pod directory there it does not know: each
#: node mounts directories of its own over them in its mount namespace.
POD_LOGS = Path("/var/log/pods")
CONTAINER_LOGS = Path("/var/log/containers")


class NodeError(RuntimeError):
    """The node could not be started or torn down; the message names the step and its log."""


@dataclass
class RealNode(NodeTeardown):
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
        stale_netns = stale_pod_netns()
        log.warning("clearing what a crashed node run left: netns %s, %s",
                    [netns, *stale_netns], run_dir)  # fmt: skip
        stale_workdirs = [d for d in Path("/var/tmp").glob(f"{self.name}.*") if d != self.workdir]
        self._unmount_under(run_dir, *stale_workdirs)
        for name in stale_netns:
            remove_netns_file(name)
        self._remove_cgroups()
        self._remove_link()
        shutil.rmtree(run_dir, ignore_errors=True)
        for workdir in stale_workdirs:
            shutil.rmtree(workdir, ignore_errors=True)

    def _other_node_processes(self) -> list[int]:
        in_netns = sh("ip", "netns", "pids", self.net.netns, check=False).stdout.split()
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
        sh("ip", "netns", "add", n.netns)
        sh("ip", "link", "add", n.host_veth, "type", "veth", "peer", "name", n.node_veth,
           "netns", n.netns)  # fmt: skip
        sh("ip", "addr", "add", f"{n.host_ip}/{LINK_PREFIX}", "dev", n.host_veth)
        sh("ip", "link", "set", n.host_veth, "up")
        node = ["ip", "netns", "exec", n.netns]
        sh(*node, "ip", "addr", "add", f"{n.node_ip}/{LINK_PREFIX}", "dev", n.node_veth)
        sh(*node, "ip", "link", "set", n.node_veth, "up")
        sh(*node, "ip", "link", "set", "lo", "up")
        # Every node reaches the apiserver (HOST_IP) through its own link: the host delivers
        # what is addressed to it whichever link it came in on.
        sh(*node, "ip", "route", "add", "default", "via", n.host_ip)
        # A Service address kube-proxy has not translated (yet) fails at once instead of
        # looping between host and node until its TTL runs out.
        sh(*node, "ip", "route", "add", "unreachable", self.service_cidr)
        # Per-namespace: forwarding between pods, Services and the link happens in the node.
        sh(*node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for cidr in self._host_routes():
            sh("ip", "route", "add", cidr, "via", n.node_ip, "dev", n.host_veth)

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
        sh("mount", "--bind", str(run_dir), str(run_dir))
        sh("mount", "--make-private", str(run_dir))
        self.mount_ns.touch()
        binds = []
        for shared, own in ((POD_LOGS, self.workdir / "pod-logs"),
                            (CONTAINER_LOGS, self.workdir / "container-logs")):  # fmt: skip
            own.mkdir(parents=True, exist_ok=True)
            if not shared.exists():
                shared.mkdir(parents=True)
                self._made_dirs.append(shared)
            binds.append(f"mount --bind {shlex.quote(str(own))} {shlex.quote(str(shared))}")
        sh("unshare", f"--mount={self.mount_ns}", "--propagation", "unchanged", "--",
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
        return sh(str(self.binaries.ctr), "--address", str(self.socket), "-n", "k8s.io",
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
