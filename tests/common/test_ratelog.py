from __future__ import annotations

import logging

import pytest

from common.ratelog import RateLimitedLog


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_at_most_burst_lines_per_interval_then_the_suppressed_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    lines = RateLimitedLog(logging.getLogger("test.ratelog"), burst=3, interval_s=10.0,
                           clock=clock)
    caplog.set_level(logging.INFO, "test.ratelog")
    for i in range(700):  # a flood of bad connections within one interval
        lines.warning("bad connection %d", i)
    assert [r.getMessage() for r in caplog.records] == [f"bad connection {i}" for i in range(3)]
    assert lines.suppressed == 697
    clock.now = 10.0
    lines.warning("bad connection %d", 700)
    assert caplog.records[-1].getMessage() == "bad connection 700 (697 more suppressed)"
    assert caplog.records[-1].exc_info is None
    assert lines.suppressed == 0


def test_disabled_levels_cost_nothing_and_count_nothing(caplog: pytest.LogCaptureFixture) -> None:
    lines = RateLimitedLog(logging.getLogger("test.ratelog.quiet"), burst=1)
    caplog.set_level(logging.WARNING, "test.ratelog.quiet")
    for _ in range(5):
        lines.info("idle connection closed")
    assert not caplog.records and lines.suppressed == 0
