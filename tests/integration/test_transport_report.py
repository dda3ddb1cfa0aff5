"""NixlAgent.transport_of on real NIXL agents: the transport UCX selected for each loaded peer,
read from UCX's own protocol tables (nixl/_transport.py), whatever the process does to its
environment between agents."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from unittest import mock

import pytest

from kvbridge_agent.nixl import NixlAgent

pytestmark = pytest.mark.nixl


@pytest.fixture
def agents() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _agent(stack: ExitStack, role: str, **env: str) -> NixlAgent:
    with mock.patch.dict(os.environ, env):  # UCX reads UCX_TLS as the agent starts
        return stack.enter_context(NixlAgent(f"tr-{role}-{uuid.uuid4().hex[:6]}"))


def test_each_peer_is_reported_with_the_transport_ucx_chose(agents: ExitStack) -> None:
    decode, fast = _agent(agents, "decode"), _agent(agents, "fast")
    slow = _agent(agents, "slow", UCX_TLS="tcp")   # what a pod without CMA gets from UCX
    cma = decode.transport_of(decode.add_remote(fast.metadata()))
    assert cma is not None and (cma.name, cma.detail) == ("cma", "cma/memory")
    tcp = decode.transport_of(decode.add_remote(slow.metadata()))
    assert tcp is not None and tcp.name == "tcp" and tcp.detail.startswith("tcp/")
    decode.remove_remote(slow.name)
    assert decode.transport_of(slow.name) is None


def test_an_agent_made_after_the_environment_lost_the_setting_still_reports(
        agents: ExitStack) -> None:  # fmt: skip
    first = _agent(agents, "first")
    with mock.patch.dict(os.environ):
        os.environ.pop("UCX_PROTO_INFO", None)  # e.g. a test or a library restoring its env
        later = _agent(agents, "later")
    peer = _agent(agents, "peer")
    got = later.transport_of(later.add_remote(peer.metadata()))
    assert got is not None and got.name == "cma", got
    assert first.transport_of(first.add_remote(peer.metadata())).name == "cma"
