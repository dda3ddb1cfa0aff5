"""Shared helpers for bench/ scripts (run as ``.venv/bin/python bench/bench_x.py``).

Convention (CONTRACTS.md): one JSON line per measurement on stdout,
``{"name", "value", "unit", "baseline", "ratio", ...extra}``, where ``ratio`` is
``value / baseline_value`` measured side by side in the same run. Say in the name or in
``extra`` (e.g. ``higher_is_better``) which direction is better. Use from a benchmark with
``from _common import emit, best_time``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["best_time", "emit"]


def emit(
    name: str,
    value: float,
    unit: str,
    baseline: str,
    ratio: float,
    **extra: Any,
) -> dict[str, Any]:
    """Print one measurement as a JSON line on stdout and return it."""
    for field, number in (("value", value), ("ratio", ratio)):
        if not isinstance(number, int | float) or not math.isfinite(number):
            raise ValueError(f"{name}: {field} must be a finite number, got {number!r}")
    record: dict[str, Any] = {
        "name": name,
        "value": float(value),
        "unit": unit,
        "baseline": baseline,
        "ratio": float(ratio),
        **extra,
    }
    sys.stdout.write(json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()
    return record


def best_time(fn: Callable[[], object], *, min_time: float = 0.2, repeat: int = 5) -> float:
    """Best per-call wall time (seconds) of ``fn`` over ``repeat`` rounds of >= ``min_time``.

    The number of calls per round is calibrated once so that a round lasts ``min_time``.
    """
    number, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or number >= 1 << 20:
            break
        number = max(number * 2, int(number * min_time / max(elapsed, 1e-9)) + 1)
    best = elapsed / number
    for _ in range(repeat - 1):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best
