"""The agent's API client does not resend a request whose answer timed out (its sync loop is
the retry): against a server that accepts and never answers, one read costs one connection."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvbridge_agent.kube import EndpointPublisher, PodIdentity, PublishError, api_client


def test_a_timed_out_read_is_not_resent(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)  # held open, never answered

    threading.Thread(target=accept, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "http://127.0.0.1:{server.getsockname()[1]}"}}
users:
- name: u
  user: {{token: t}}
contexts:
- name: c
  context: {{cluster: c, user: u}}
current-context: c
""")
    pod = PodIdentity("p-0", "uid-0", "ns")
    publisher = EndpointPublisher(api_client(str(kubeconfig)), pod, timeout_s=0.3)
    try:
        with pytest.raises(Exception, match="Read timed out") as exc:
            publisher.get()
        assert not isinstance(exc.value, PublishError)  # a transport error, not an API answer
        assert len(accepted) == 1
    finally:
        server.close()
        for conn in accepted:
            conn.close()
