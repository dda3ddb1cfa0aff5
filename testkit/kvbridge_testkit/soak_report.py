"""The soak's figures per time window (bench/bench_soak.py): requests answered, failed (by
cause) and wrong, and time to first token, from a LoadRecord. Pure: no I/O."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge_testkit.openai_load import LoadRecord, Outcome


@dataclass(frozen=True)
class Window:
    start_s: float                   # from the soak's start
    end_s: float
    answered: int
    wrong: int
    failed: dict[str, int] = field(default_factory=dict)   # cause (error, cut) -> count
    ttft_p50_s: float | None = None  # streamed answers only
    ttft_p99_s: float | None = None


#: a leader kill follows a decode deletion by this much: the replacement pod's endpoint is
#: published after the hand-over, so the new leader is the one that pairs it
KILL_AFTER_DELETE_S = 20.0


def schedule(total_s: float, delete_every_s: float, leader_kills: int
             ) -> list[tuple[float, str]]:  # fmt: skip
    """(seconds from the start, "delete-decode" | "kill-leader"), in order: deletions every
    ``delete_every_s``; leader kills spread evenly, each ``KILL_AFTER_DELETE_S`` after the
    deletion nearest its even spot (or at that spot when there are no deletions)."""
    beats = [delete_every_s * k for k in range(1, int(total_s // delete_every_s) + 1)
             if delete_every_s * k < total_s]
    events = [(t, "delete-decode") for t in beats]
    for k in range(leader_kills):
        spot = total_s * (k + 1) / (leader_kills + 1)
        at = min(beats, key=lambda t: abs(t - spot)) + KILL_AFTER_DELETE_S if beats else spot
        events.append((at, "kill-leader"))
    return sorted(events)


def cause(outcome: Outcome, width: int = 80) -> str:
    """A failure's cause as counted: its error's class and the start of its message."""
    return outcome.error.splitlines()[0][:width] if outcome.error else "no error"


def windows(record: LoadRecord, start: float, end: float, window_s: float,
            references: Mapping[str, Mapping[str, str]]) -> list[Window]:  # fmt: skip
    """``[start, end)`` cut into windows of ``window_s`` (the last may be shorter); each
    request counts in the window where it ended."""
    if window_s <= 0 or end <= start:
        raise ValueError(f"window_s must be > 0 and end > start, got {window_s}, {start}..{end}")
    wrong = {id(o) for o in record.wrong(references)}
    out = []
    edges = [*np.arange(start, end, window_s).tolist(), end]
    for lo, hi in itertools.pairwise(edges):
        inside = [o for o in record.outcomes if lo <= o.ended < hi or o.ended == hi == end]
        answered = [o for o in inside if o.text is not None]
        ttfts = np.array([o.ttft for o in answered if o.ttft is not None], dtype=float)
        out.append(Window(
            start_s=lo - start, end_s=hi - start, answered=len(answered),
            wrong=sum(id(o) in wrong for o in answered),
            failed=dict(Counter(cause(o) for o in inside if o.text is None)),
            ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts.size else None,
            ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts.size else None))
    return out


def unanswered_seconds(record: LoadRecord, start: float, end: float,
                       longer_than_s: float = 2.0) -> float:
    """Seconds of ``[start, end]`` spent in stretches longer than ``longer_than_s`` without
    an answer: how long the stack served nothing (a busy stack answers every ~0.3 s)."""
    ended = sorted(o.ended for o in record.answered if start <= o.ended <= end)
    gaps = np.diff(np.array([start, *ended, end], dtype=float))
    return float(gaps[gaps > longer_than_s].sum())


def table(rows: list[Window]) -> str:
    """The windows as a fixed-width text table, one line each."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    lines = [f"{'window':>13} {'answered':>8} {'failed':>6} {'wrong':>5} "
             f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11}  causes"]
    for w in rows:
        lines.append(
            f"{w.start_s / 60:5.1f}-{w.end_s / 60:5.1f}m {w.answered:>8} "
            f"{sum(w.failed.values()):>6} {w.wrong:>5} {ms(w.ttft_p50_s):>11} "
            f"{ms(w.ttft_p99_s):>11}  {w.failed or ''}")
    return "\n".join(lines)
