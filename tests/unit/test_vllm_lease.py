"""The lease arithmetic between a kvbridge prefill and decode (kvbridge_agent.vllm._lease):
when a decode reads, declines, and how long its read may take."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.nixl import CompletionTracker, heartbeat_extension_s
from kvbridge_agent.vllm._lease import HeartbeatLog, decide_read, read_deadline


def test_without_heartbeats_or_extension_the_stated_deadline_holds() -> None:
    assert read_deadline(100.0, [], 20.0, 2.0) == 100.0
    assert read_deadline(100.0, [90.0, 95.0], None, 2.0) == 100.0


def test_heartbeats_chain_only_while_each_arrives_in_time() -> None:
    # 95 + 2 < 100: extends to 115; 110 + 2 < 115: 130; 129 + 2 >= 130: too late, no effect.
    assert read_deadline(100.0, [95.0, 110.0, 129.0], 20.0, 2.0) == 130.0
    # The first heartbeat came too late: none of the later ones can revive the lease.
    assert read_deadline(100.0, [99.0, 110.0], 20.0, 2.0) == 100.0


@given(stated=st.floats(0, 1e4), sent=st.lists(st.floats(0, 1e4), max_size=12),
       ext=st.floats(0.1, 100), margin=st.floats(0, 10))
def test_the_deadline_matches_a_producer_that_receives_heartbeats_within_the_margin(
        stated: float, sent: list[float], ext: float, margin: float) -> None:
    """Simulate the producer's tracker: each heartbeat arrives ``margin`` after it was sent
    and extends only a lease still held. The decode's deadline is never later than the
    tracker's (it may be earlier: a heartbeat arriving just in time is not counted)."""
    sent = sorted(sent)
    now = [0.0]
    tracker = CompletionTracker(lease_s=ext * 3 / 2, clock=lambda: now[0])
    tracker.register("r", lease_s=stated)
    last = stated
    for t in sent:
        now[0] = t + margin
        if tracker.expire():
            break        # freed at ``last``: later heartbeats find nothing to extend
        tracker.process_one("d", b"HB:r")
        last = tracker.expiry("r")
    assert read_deadline(stated, sent, ext, margin) <= last + 1e-6


def test_decide_read_declines_within_margin_plus_clock_error() -> None:
    d = decide_read(97.5, 100.0, margin_s=2.0, clock_error_s=0.6, extension_s=20.0,
                    transfer_timeout_s=30.0)
    assert not d.read and d.left_s == pytest.approx(2.5)
    d = decide_read(97.0, 100.0, margin_s=2.0, clock_error_s=0.5, extension_s=20.0,
                    transfer_timeout_s=30.0)
    assert d.read


def test_a_read_ends_while_the_prefill_holds_the_blocks() -> None:
    # Plenty of lease left: no heartbeat; the read must end 2.5 s before the deadline.
    d = decide_read(90.0, 100.0, margin_s=2.0, clock_error_s=0.5, extension_s=20.0,
                    transfer_timeout_s=30.0)
    assert d.read and not d.heartbeat and d.timeout_s == pytest.approx(7.5)
    d = decide_read(90.0, 100.0, margin_s=2.0, clock_error_s=0.5, extension_s=20.0,
                    transfer_timeout_s=5.0)
    assert not d.heartbeat and d.timeout_s == 5.0
    # 3 s left (0.5 s after the guard): a heartbeat first holds the blocks until now + 20,
    # and the read may take until 2.5 s before that.
    d = decide_read(97.0, 100.0, margin_s=2.0, clock_error_s=0.5, extension_s=20.0,
                    transfer_timeout_s=30.0)
    assert d.read and d.heartbeat and d.timeout_s == pytest.approx(17.5)
    # Extension unknown: no heartbeat would help; only the stated deadline counts.
    d = decide_read(97.0, 100.0, margin_s=2.0, clock_error_s=0.5, extension_s=None,
                    transfer_timeout_s=30.0)
    assert not d.heartbeat and d.timeout_s == pytest.approx(0.5)


@given(now=st.floats(0, 200), deadline=st.floats(0, 200), margin=st.floats(0, 5),
       error=st.floats(0, 1), ext=st.one_of(st.none(), st.floats(0.1, 60)),
       timeout=st.floats(0.1, 60))
def test_every_read_ends_a_guard_before_the_prefill_may_free(
        now: float, deadline: float, margin: float, error: float, ext: float | None,
        timeout: float) -> None:
    d = decide_read(now, deadline, margin_s=margin, clock_error_s=error, extension_s=ext,
                    transfer_timeout_s=timeout)
    if not d.read:
        assert deadline - now <= margin + error
        return
    held = max(deadline, now + ext) if d.heartbeat and ext else deadline
    assert 0 < d.timeout_s <= timeout
    assert now + d.timeout_s <= held - (margin + error) + 1e-9


def test_heartbeat_log_keeps_send_times_until_taken_and_is_bounded() -> None:
    log = HeartbeatLog(per_request=3, max_age_s=10.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        log.record("P", ["a", "b"], t)
    assert log.take("P", "a") == [2.0, 3.0, 4.0]
    assert log.take("P", "a") == [] and len(log) == 1
    log.prune(now=20.0)
    assert len(log) == 0


def test_heartbeat_extension_is_two_thirds_of_the_lease() -> None:
    assert heartbeat_extension_s(30) == pytest.approx(20.0)
    now = [0.0]
    tracker = CompletionTracker(lease_s=6, clock=lambda: now[0])
    tracker.register("r", lease_s=1.0)
    now[0] = 0.5
    tracker.process_one("d", b"HB:r")
    assert tracker.expiry("r") == pytest.approx(0.5 + heartbeat_extension_s(6))
