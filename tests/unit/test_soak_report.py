"""The soak's per-window figures (kvbridge_testkit.soak_report)."""

from __future__ import annotations

import pytest

from kvbridge_testkit.openai_load import LoadRecord, Outcome
from kvbridge_testkit.soak_report import schedule, table, unanswered_seconds, windows

REFS = {"a": {"p": "x y"}}


def record() -> LoadRecord:
    return LoadRecord([
        Outcome("p", True, 0.0, 1.0, "a", "x y", first_token=0.2),
        Outcome("p", True, 1.0, 2.0, "a", "x y", first_token=1.4),
        Outcome("p", False, 2.0, 3.0, "a", "x y"),
        Outcome("p", False, 3.0, 4.0, "a", "wrong"),                   # second window
        Outcome("p", True, 4.0, 5.0, error="APIConnectionError: Connection error.\nmore"),
        Outcome("p", True, 5.0, 7.0, "a", "x y", first_token=6.0),
    ])


def test_requests_count_where_they_ended_with_ttft_from_streams_only() -> None:
    first, second = windows(record(), 0.0, 7.0, 3.5, REFS)
    assert (first.answered, first.wrong, first.failed) == (3, 0, {})
    assert first.ttft_p50_s == pytest.approx(0.3) and first.ttft_p99_s == pytest.approx(0.398)
    assert (second.answered, second.wrong) == (2, 1)
    assert second.failed == {"APIConnectionError: Connection error.": 1}
    assert second.ttft_p50_s == pytest.approx(1.0)
    assert (second.start_s, second.end_s) == (3.5, 7.0)


def test_a_window_without_streams_has_no_ttft_and_the_table_says_so() -> None:
    (only,) = windows(LoadRecord([Outcome("p", False, 0.0, 1.0, "a", "x y")]), 0.0, 2.0, 5.0,
                      REFS)
    assert only.ttft_p99_s is None
    assert table([only]).splitlines()[1].split()[2:7] == ["1", "0", "0", "-", "-"]


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        windows(record(), 0.0, 5.0, 0, REFS)


def test_the_schedule_deletes_on_the_beat_and_kills_the_leader_off_it() -> None:
    plan = schedule(1800, 180, 2)
    assert [t for t, what in plan if what == "delete-decode"] == [180 * k for k in range(1, 10)]
    # after the deletions nearest 600 s and 1200 s: their replacements pair after the hand-over
    assert [t for t, what in plan if what == "kill-leader"] == [560, 1280]
    assert plan == sorted(plan)
    assert schedule(60, 180, 1) == [(30, "kill-leader")]


def test_unanswered_seconds_add_up_the_long_stretches_only() -> None:
    # answers (a wrong one too) end at 1, 2, 3, 4 and 7; the failure at 5 is none: one 3 s
    # stretch, and 0.5 s after the last answer
    assert unanswered_seconds(record(), 0.0, 7.5) == pytest.approx(3.0)
    assert unanswered_seconds(record(), 0.0, 7.5, longer_than_s=0.4) == pytest.approx(7.5)
