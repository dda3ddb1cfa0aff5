"""The operator's runtime: the one object handlers share through kopf's memo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge_operator import runtime
from kvbridge_operator.config import Settings


def make() -> runtime.Runtime:
    return runtime.Runtime(Settings(), kube=None)  # type: ignore[arg-type]


def test_node_label_changes_replan_and_deleted_nodes_are_forgotten() -> None:
    rt = make()
    assert not rt.node_changed("n1", {"zone": "a"})          # first sight: nothing to redo
    assert not rt.node_changed("n1", {"zone": "a"})          # same labels
    assert rt.node_changed("n1", {"zone": "b"})              # TopologyAware must re-plan
    assert rt.tracked()["nodes"] == 1
    assert rt.node_changed("n1", None)                       # deleted: re-plan, forget it
    assert rt.nodes == {} and rt.tracked()["nodes"] == 0
    assert not rt.node_changed("n2", None)                   # never seen: nothing to do


def test_a_node_losing_or_regaining_readiness_replans() -> None:
    rt = make()
    assert not rt.node_changed("n1", {"zone": "a"})
    assert rt.node_changed("n1", {"zone": "a"}, lost=True)   # NotReady: drop its pairs
    assert not rt.node_changed("n1", {"zone": "a"}, lost=True)
    assert rt.node_changed("n1", {"zone": "a"})              # Ready again: pairs re-form


@pytest.mark.parametrize(("conditions", "lost"), [
    (None, False),                                            # no status yet: not judged
    ([{"type": "MemoryPressure", "status": "False"}], False),
    ([{"type": "Ready", "status": "True"}], False),
    ([{"type": "Ready", "status": "False"}], True),
    ([{"type": "Ready", "status": "Unknown"}], True),         # the kubelet stopped posting
])  # fmt: skip
def test_a_node_is_lost_when_its_ready_condition_is_not_true(conditions, lost) -> None:
    from kvbridge_operator.main import node_lost

    assert node_lost({"conditions": conditions} if conditions else {}) is lost


def test_handlers_find_the_runtime_in_the_memo_or_are_told_why_not() -> None:
    rt = make()
    assert runtime.from_memo(SimpleNamespace(runtime=rt)) is rt
    with pytest.raises(RuntimeError, match="startup handler has not run"):
        runtime.from_memo(SimpleNamespace())


def test_settings_are_read_once_per_process(monkeypatch) -> None:
    runtime.settings.cache_clear()
    monkeypatch.setenv("KVBRIDGE_DEBOUNCE", "0.25")
    first = runtime.settings()
    monkeypatch.setenv("KVBRIDGE_DEBOUNCE", "0.75")
    assert runtime.settings() is first and first.debounce == 0.25
    runtime.settings.cache_clear()
