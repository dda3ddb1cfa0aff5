"""The rollout tests' judge (kvbridge_testkit.openai_load): answers held to the reference of
the revision that served them, failures told apart, the longest time without an answer."""

from __future__ import annotations

from kvbridge_testkit.openai_load import LoadRecord, Outcome


def test_wrong_answers_failures_and_gaps() -> None:
    refs = {"a": {"p": "x y"}, "b": {"p": "z w"}}
    load = LoadRecord([
        Outcome("p", False, 0.0, 1.0, "a", "x y"),
        Outcome("p", True, 0.5, 2.0, "b", "z w"),
        Outcome("p", True, 1.0, 6.0, error="APIConnectionError: Connection error."),
        Outcome("p", False, 2.0, 7.5, "b", "x y"),         # b's request with a's answer
        Outcome("p", False, 3.0, 8.0, "c", "x y"),         # a revision with no reference
    ])
    assert [o.ended for o in load.wrong(refs)] == [7.5, 8.0]
    assert [o.error for o in load.failed] == ["APIConnectionError: Connection error."]
    assert load.per_revision() == {"a": 1, "b": 2, "c": 1}
    assert load.longest_gap(0.0, 10.0) == 5.5                # 2.0 -> 7.5
    assert load.longest_gap(7.6, 9.0) == 1.0                 # 8.0 -> 9.0
    assert LoadRecord().longest_gap(1.0, 4.0) == 3.0
