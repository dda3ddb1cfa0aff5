"""The 30-minute soak of the serving stack on the real node (issue #37): routed load while
decode pods are deleted and the leading operator is SIGKILLed; prints requests answered,
failed (by cause) and wrong, p50/p99 time to first token per window, each leader hand-over and
decode replacement, and the routers' and operators' memory at start and end.

Runs ``tests/node/soak_serving.py`` under pytest (it shares the node tests' fixtures: control
plane, kubelet nodes, chart, examples/serving/), then reads what it wrote. Needs root and what
``make test`` builds (node images, the vLLM image). About 40 minutes with the defaults; never
part of ``make test``. Exit status: pytest's (non-zero if any answer was wrong or the stack
could not start).

    .venv/bin/python bench/bench_soak.py --minutes 30 --delete-every 180 --leader-kills 2

Lines: ``soak.answered`` (value: answered requests; ratio: answered / all), ``soak.wrong``
(must be 0), ``soak.ttft_p99.wN`` per window (seconds; ratio against the first window's),
``soak.handover.N`` (seconds from SIGKILL until another replica held the Lease; ratio against
the lease duration, 15 s), ``soak.decode_replaced`` (the slowest deleted decode's time until
its replacement was paired and verified; ratio against the deletion interval),
``soak.unanswered`` (seconds in stretches over 2 s without an answer; ratio against the
soak's length), ``soak.memory.<pod>`` (end RSS; ratio end / start). Each client pauses 0.5 s
after a failed request (``KVB_SOAK_PAUSE_AFTER_FAILURE_S``), as a client backing off would.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import emit
from kvbridge_testkit import REPO
from kvbridge_testkit.soak_report import Window, table

LEASE_DURATION_S = 15.0   # the chart's operator.leaderElection.leaseDurationSeconds


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--delete-every", type=float, default=180.0,
                        help="seconds between decode pod deletions")
    parser.add_argument("--leader-kills", type=int, default=2,
                        help="SIGKILLs of the leading operator, spread evenly")
    parser.add_argument("--window", type=float, default=300.0,
                        help="seconds per reported window")
    parser.add_argument("--clients", type=int, default=4, help="concurrent openai clients")
    args = parser.parse_args()
    for name in ("minutes", "delete_every", "window"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.clients < 1 or args.leader_kills < 0:
        parser.error("--clients must be >= 1 and --leader-kills >= 0")
    return args


def report(results: dict) -> None:
    rows = [Window(**w) for w in results["windows"]]
    print(table(rows), file=sys.stderr)
    for event in results["events"]:
        print(f"# {event}", file=sys.stderr)
    total = results["answered"] + results["failed"]
    emit("soak.answered", results["answered"], "requests", "all requests sent",
         results["answered"] / max(total, 1), failed=results["failed"],
         failures=results["failures"], longest_gap_s=results["longest_gap_s"],
         minutes=results["minutes"], clients=results["clients"], higher_is_better=True)
    emit("soak.wrong", results["wrong"], "requests", "answers", results["wrong"] / max(
        results["answered"], 1), higher_is_better=False)
    first = next((w.ttft_p99_s for w in rows if w.ttft_p99_s), None)
    for i, w in enumerate(rows):
        if w.ttft_p99_s is not None and first:
            emit(f"soak.ttft_p99.w{i}", w.ttft_p99_s, "s", "the first window's p99 TTFT",
                 w.ttft_p99_s / first, ttft_p50_s=w.ttft_p50_s, window=[w.start_s, w.end_s],
                 answered=w.answered, failed=w.failed, higher_is_better=False)
    kills = [e for e in results["events"] if e["what"] == "kill-leader"]
    for i, e in enumerate(kills):
        if e.get("handover_s") is None:
            print(f"# leader kill {i}: no hand-over measured: {e}", file=sys.stderr)
            continue
        emit(f"soak.handover.{i}", e["handover_s"], "s", "the Lease duration",
             e["handover_s"] / LEASE_DURATION_S, killed=e["killed"], leader=e["leader"],
             replacement_paired_after_handover_s=e.get("replacement_paired_after_handover_s"),
             higher_is_better=False)
    deletions = [e for e in results["events"] if e["what"] == "delete-decode"]
    done = [e["repaired_s"] for e in deletions if e.get("repaired_s") is not None]
    if done:
        emit("soak.decode_replaced", max(done), "s", "the deletion interval",
             max(done) / results["delete_every_s"], deletions=len(deletions),
             repaired=len(done), repaired_s=[e.get("repaired_s") for e in deletions],
             ready_s=[e.get("replacement_ready_s") for e in deletions], higher_is_better=False)
    emit("soak.unanswered", results["seconds_without_answer"], "s",
         "the soak's length (stretches over 2 s without an answer)",
         results["seconds_without_answer"] / (results["minutes"] * 60),
         pause_after_failure_s=results["pause_after_failure_s"],
         serving_pod_restarts=results["serving_pod_restarts"], higher_is_better=False)
    print(f"# KVEndpoint statuses that went backwards: {results['status_backwards'] or 'none'}",
          file=sys.stderr)
    for pod, end in results["memory_end"].items():
        start = results["memory_start"].get(pod)
        if start:
            emit(f"soak.memory.{pod}", end["rss_bytes"], "bytes", "its RSS at the start",
                 end["rss_bytes"] / start["rss_bytes"], restarts=end["restarts"],
                 higher_is_better=False)


def main() -> int:
    args = arguments()
    with tempfile.TemporaryDirectory(prefix="kvb-soak.") as tmp:
        out = Path(tmp) / "results.json"
        env = {**os.environ, "KVB_SOAK_MINUTES": str(args.minutes),
               "KVB_SOAK_DELETE_EVERY_S": str(args.delete_every),
               "KVB_SOAK_LEADER_KILLS": str(args.leader_kills),
               "KVB_SOAK_WINDOW_S": str(args.window), "KVB_SOAK_CLIENTS": str(args.clients),
               "KVB_SOAK_RESULTS": str(out)}
        rc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o",
             "log_cli=true", "-o", "log_cli_level=INFO", "tests/node/soak_serving.py"],
            cwd=REPO, env=env, stdout=sys.stderr, check=False).returncode
        if out.exists():
            report(json.loads(out.read_text()))
        else:
            print("# the soak wrote no results (see pytest's output above)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
