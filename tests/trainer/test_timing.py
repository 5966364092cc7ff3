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


def test_every_phase_is_also_timed_in_thread_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`compute_cpu` holds the ended iteration's CPU time of each compute phase,
    `machinery_cpu` of each other timed phase, and the next iteration starts from zero."""
    clock, cpu = FakeClock(), FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    monkeypatch.setattr(timing.time, "thread_time", cpu)
    timer = PhaseTimer()
    with timer.phase("forward"):
        clock.now += 0.5  # waited for a core half the time
        cpu.now += 0.25
    with timer.phase("boundary"):
        cpu.now += 1.0
    with timer.phase("backward"):
        cpu.now += 0.125
    assert timer.end_iteration()["forward"] == 0.5
    assert timer.compute_cpu == {"forward": 0.25, "backward": 0.125, "dense_optimizer": 0.0}
    assert timer.machinery_cpu == {**dict.fromkeys(timing.MACHINERY_PHASES, 0.0), "boundary": 1.0}
    assert set(timing.MACHINERY_PHASES) == set(timing.PHASES) - set(timing.COMPUTE_PHASES) - {"other"}
    with timer.phase("dense_optimizer"):
        cpu.now += 0.0625
    with timer.phase("sync_now"):
        cpu.now += 0.5
    with timer.phase("sync_now"):  # a phase timed twice in one iteration adds up
        cpu.now += 0.25
    timer.end_iteration()
    assert timer.compute_cpu == {"forward": 0.0, "backward": 0.0, "dense_optimizer": 0.0625}
    assert timer.machinery_cpu["sync_now"] == 0.75 and timer.machinery_cpu["boundary"] == 0.0
