"""Child-process helpers shared by the harness: free loopback ports for children to bind,
and stopping a child with a deadline."""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free TCP port for a child process to bind later, below the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: until the child binds it, any outgoing
    connection on the machine may be given it ("Address already in use"). Ports below the
    range are only taken by explicit binds; each is handed out once per process.
    """
    low = _ephemeral_low()
    rng = secrets.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
