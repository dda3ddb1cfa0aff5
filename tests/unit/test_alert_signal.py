"""What the observability test expects of each alert while things are healthy."""

from __future__ import annotations

from kvbridge_testkit.prometheus import signal


def test_a_threshold_comes_off() -> None:
    assert signal("sum(rate(x_total[5m])) > 0.05") == "sum(rate(x_total[5m]))"


def test_absent_gives_what_must_exist() -> None:
    assert signal("absent(up{job=\"op\"})") == 'up{job="op"}'


def test_a_set_operation_has_no_healthy_signal() -> None:
    """`engines > 0 unless pairs > 0` is empty whenever every revision has a pair."""
    expr = ("sum by (namespace, transfer, revision) (kvbridge_transfer_revision_engines) > 0\n"
            "unless on (namespace, transfer, revision) kvbridge_transfer_revision_pairs > 0")
    assert signal(expr) is None
