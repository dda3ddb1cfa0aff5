"""The agent service's side, outcome and error types: one side per (role, mode), errors that
callers can catch as the agent's own or as the built-in errors they caught before."""

from __future__ import annotations

import pytest

from kvbridge_agent.service import (
    AgentClosedError,
    AgentError,
    HandshakeOutcome,
    PeerReport,
    Side,
    StalePeerError,
    UnknownRequestError,
    WrongSideError,
)


@pytest.mark.parametrize(("role", "mode", "side", "moves"), [
    ("decode", "pull", Side.PULLER, True),
    ("prefill", "pull", Side.RECEIVER, False),
    ("prefill", "push", Side.PUSHER, True),
    ("decode", "push", Side.RECEIVER, False),
])
def test_side_is_chosen_once_from_role_and_mode(role, mode, side, moves) -> None:
    assert Side.of(role, mode) is side
    assert side.moves is moves


@pytest.mark.parametrize(("error", "builtin"), [
    (WrongSideError, RuntimeError), (AgentClosedError, RuntimeError),
    (StalePeerError, RuntimeError), (UnknownRequestError, KeyError),
])
def test_agent_errors_are_the_agents_and_the_builtin_ones(error, builtin) -> None:
    exc = error("request 'r1' is not expected")
    assert isinstance(exc, AgentError) and isinstance(exc, builtin)
    assert str(exc) == "request 'r1' is not expected"   # no KeyError quoting


def test_handshake_outcome_is_the_metric_label_and_the_report_reason() -> None:
    rep = PeerReport("p-0", "P", 3, False, "no reply", HandshakeOutcome.TIMEOUT)
    assert rep.reason == "timeout" and rep.reason.value == "timeout"
    assert rep.to_status()["state"] == "Failed"
    assert {o.value for o in HandshakeOutcome} == {
        "succeeded", "incompatible", "timeout", "rejected", "stale", "error"}
