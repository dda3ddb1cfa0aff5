"""A pod's duties start and stop in one place; the environment's names come from one module."""

from __future__ import annotations

import urllib.request

from kvbridge_agent import env as names
from kvbridge_agent.kube import PodDuties


def test_metrics_only_outside_a_pod() -> None:
    duties = PodDuties.start(object(), metrics_port=0, metrics_addr="127.0.0.1")
    try:
        assert duties.sync is None and duties.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{duties.metrics_port}/metrics",
                                    timeout=5) as r:
            assert r.status == 200
    finally:
        duties.stop()
        duties.stop()   # idempotent


def test_nothing_started_without_a_port_or_a_publisher() -> None:
    duties = PodDuties.start(object())
    assert (duties.metrics_port, duties.sync) == (None, None)


def test_environment_readers() -> None:
    assert names.in_pod({names.POD_NAME: "p", names.POD_UID: "u"})
    assert not names.in_pod({names.POD_NAME: "p"})
    assert names.metrics_port({}) is None
    assert names.metrics_port({names.AGENT_METRICS_PORT: "0"}) == 0
