"""A tiny byte forwarder so an agent inside a network namespace can still reach the
apiserver on the host's loopback: host side ``unix socket -> 127.0.0.1:apiserver``, netns
side ``127.0.0.1:apiserver (netns loopback) -> unix socket``. Unix sockets live in the
filesystem, not in a network namespace, so only the apiserver traffic takes this path; the
side channel and NIXL use the veth link.

Threads: one accept thread per bridge, two pump threads per connection; all daemon threads,
closed with the bridge.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Bridge:
    """Accept on ``listener``; for each connection, open ``connect()`` and pump both ways."""

    def __init__(self, listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
        self.listener = listener
        self.connect = connect
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="bridge")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            try:
                b = self.connect()
            except OSError:
                a.close()
                continue
            self._conns += [a, b]
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()
            threading.Thread(target=_pump, args=(b, a), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()


def unix_to_tcp(path: str, host: str, port: int) -> Bridge:
    """Host side: listen on unix socket ``path``, forward to ``host:port``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return Bridge(s, lambda: socket.create_connection((host, port), timeout=10))


def tcp_to_unix(host: str, port: int, path: str) -> Bridge:
    """Netns side: listen on ``host:port`` (inside the namespace), forward to ``path``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(64)

    def connect() -> socket.socket:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(path)
        c.settimeout(None)
        return c

    return Bridge(s, connect)
