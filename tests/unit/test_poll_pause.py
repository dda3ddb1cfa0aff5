"""How often a caller blocked on a transfer polls: proportional to the time taken so far, so
completion is seen within a small share of any transfer's duration, and bounded both ways."""

from __future__ import annotations

import pytest

from kvbridge_agent.service._transfers import (
    MAX_POLL_PAUSE_S,
    MIN_POLL_PAUSE_S,
    POLLS_PER_ELAPSED,
    poll_pause,
)


@pytest.mark.parametrize("elapsed", [0.0, 1e-6, 500e-6])
def test_a_young_transfer_is_polled_at_the_floor(elapsed: float) -> None:
    assert poll_pause(elapsed) == MIN_POLL_PAUSE_S


@pytest.mark.parametrize("elapsed", [0.002, 0.009, 0.03])
def test_the_pause_is_a_fixed_share_of_the_elapsed_time(elapsed: float) -> None:
    assert poll_pause(elapsed) == pytest.approx(elapsed / POLLS_PER_ELAPSED)
    assert poll_pause(elapsed) / elapsed <= 0.05  # seen within 5% of its duration


@pytest.mark.parametrize("elapsed", [0.05, 1.0, 3600.0])
def test_a_long_transfer_is_still_polled_every_two_ms(elapsed: float) -> None:
    assert poll_pause(elapsed) == MAX_POLL_PAUSE_S == 0.002
