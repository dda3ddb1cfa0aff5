"""A real node's teardown (:class:`NodeTeardown`, a base of ``node.RealNode``): drain, stop
the daemons, then remove whatever the node made (tasks, shims, mounts, cgroups, network
namespaces, the link and routes, directories); ``leftovers()`` reports what survived.

Every step runs even when an earlier one failed, since each removes something else, so
``stop`` is idempotent and also clears what a half-started node made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge_testkit.node_net import (
    BRIDGE,
    CGROUP_ROOT,
    NodeNet,
    host_rules,
    host_sysctls,
    remove_netns_file,
    sh,
    stale_pod_netns,
)
from kvbridge_testkit.procs import terminate

if TYPE_CHECKING:
    from kvbridge_testkit.cluster import LocalCluster

log = logging.getLogger("kvbridge.node")


class NodeTeardown:
    """Teardown of ``node.RealNode``, which holds the state named here."""

    name: str
    net: NodeNet
    workdir: Path | None
    socket: Path
    cluster: LocalCluster | None
    service_cidr: str
    _procs: dict[str, subprocess.Popen[bytes]]
    _made_dirs: list[Path]
    _netns_before: set[str]
    _host_rules_before: list[str]
    _sysctls_before: dict[str, str]

    def ctr(self, *args: str, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """``ctr`` against this node's containerd, in the Kubernetes namespace."""
        raise NotImplementedError

    def _host_routes(self) -> list[str]:
        """What the host routes into this node: its pods, and the Service range if it is the
        node that translates the host's Service traffic."""
        return [self.net.pod_cidr, *([self.service_cidr] if self.net.translates_host_services
                                     else [])]  # fmt: skip

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
        if not sh("ip", "-o", "addr", "show", "to", self.cluster.address).stdout.strip():
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
            sh("umount", "-l", point, check=False)

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
        stale = set(stale_pod_netns())
        for name in self._new_netns():
            if name in stale:
                remove_netns_file(name)

    def _remove_link(self) -> None:
        n = self.net
        for cidr in self._host_routes():
            sh("ip", "route", "del", cidr, "via", n.node_ip, check=False)
        sh("ip", "link", "del", n.host_veth, check=False)
        sh("ip", "netns", "del", n.netns, check=False)

    def _remove_made_dirs(self) -> None:
        for path in self._made_dirs:
            with contextlib.suppress(OSError):
                path.rmdir()
        self._made_dirs.clear()

    def leftovers(self) -> dict[str, list[str]]:
        """What a stopped node left on the host, by kind; empty lists when clean."""
        links = sh("ip", "-o", "link", "show").stdout
        sysctls = host_sysctls()
        routes = sh("ip", "route", "show").stdout
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
