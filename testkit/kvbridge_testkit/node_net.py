"""Names and addresses of the real nodes (:mod:`kvbridge_testkit.node`) and the host-side
state they must leave as it was.

Everything about a node's network follows from its index (:class:`NodeNet`), so two nodes
never collide and a crashed run's remains are found by the same names. :func:`connect` joins
two nodes' namespaces directly; :func:`host_rules` and :func:`host_sysctls` are what a node's
teardown compares against.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

LINK_PREFIX = 30
#: The pod network of every node: node i takes 10.88.i.0/24 of it.
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
BRIDGE = "kvb0"
CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout)


def stale_pod_netns() -> list[str]:
    """Pod network namespaces (CNI names them ``cni-<uuid>``) that no process uses any more."""
    netns_dir = Path("/run/netns")
    names = sorted(n for n in os.listdir(netns_dir) if n.startswith("cni-")) \
        if netns_dir.is_dir() else []
    return [n for n in names if not sh("ip", "netns", "pids", n, check=False).stdout.split()]


def remove_netns_file(name: str) -> None:
    path = Path("/run/netns") / name
    sh("umount", "-l", str(path), check=False)
    with contextlib.suppress(OSError):
        path.unlink()


def host_rules() -> list[str]:
    """The host's iptables rules and chains (comments and counters dropped): the node's live in
    its own network namespace, so these must not change."""
    out = sh("iptables-save").stdout.splitlines()
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


class Networked(Protocol):
    """What linking needs of a node (a RealNode): its index and network namespace. A protocol,
    so this module never imports the node module that builds on it."""

    index: int
    net: NodeNet


def connect(a: Networked, b: Networked) -> None:
    """A direct link between two nodes' network namespaces and a route to each other's pods:
    one pod network over both nodes. The host does not forward (its ``ip_forward`` stays as it
    is), so node-to-node traffic never passes through it; the link goes with either namespace."""
    first, second = sorted((a, b), key=lambda n: n.index)
    i, j = first.index, second.index
    net = f"10.87.{200 + i}"  # one /30 per pair of nodes
    ends = [(first, f"kvbp{j}", f"{net}.{4 * j + 1}"), (second, f"kvbp{i}", f"{net}.{4 * j + 2}")]
    sh("ip", "-n", first.net.netns, "link", "add", ends[0][1], "type", "veth", "peer",
       "name", ends[1][1], "netns", second.net.netns)  # fmt: skip
    for node, dev, addr in ends:
        sh("ip", "-n", node.net.netns, "addr", "add", f"{addr}/{LINK_PREFIX}", "dev", dev)
        sh("ip", "-n", node.net.netns, "link", "set", dev, "up")
    for (node, _, _), (other, _, other_addr) in (ends, ends[::-1]):
        sh("ip", "-n", node.net.netns, "route", "add", other.net.pod_cidr, "via", other_addr)
