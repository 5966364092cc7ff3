"""The phases of an iteration add up to it: `other` holds what no phase timed."""

from __future__ import annotations

import pytest

from trainer import timing
from trainer.timing import PHASES, PhaseTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_add_up_to_the_wall_time_between_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    timer = PhaseTimer()
    clock.now += 5.0  # start-up, before the loop
    timer.restart()
    with timer.phase("forward"):
        clock.now += 0.25
    clock.now += 0.5  # untimed: statistics, a record
    timer.add("wait_directive", 0.125)
    clock.now += 0.125
    first = timer.end_iteration()
    assert list(first) == list(PHASES)
    assert first["forward"] == 0.25 and first["wait_directive"] == 0.125 and first["other"] == 0.5
    assert sum(first.values()) == pytest.approx(0.875)
    with timer.phase("backward"):
        clock.now += 1.0
    second = timer.end_iteration()
    assert second["backward"] == 1.0 and second["other"] == 0.0 and second["forward"] == 0.0
    assert timer.total["other"] == 0.5 and timer.total["forward"] == 0.25
