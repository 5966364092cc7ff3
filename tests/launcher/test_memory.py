"""Every role's RSS over a run: the launcher's sampler, its file, and the per-role figures."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launcher.memory import (
    RSS_FILE,
    RssRecorder,
    RssSample,
    format_rss,
    read_rss,
    read_cpu_s,
    read_rss_mb,
    rss_curves,
    summarise_rss,
)
from launcher.plots import plot_rss

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_this_process_has_an_rss_and_a_reaped_one_has_none() -> None:
    assert 1 < read_rss_mb(os.getpid()) < 100_000  # type: ignore[operator]
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert read_rss_mb(child.pid) is None


def test_the_recorder_samples_at_most_once_an_interval_and_skips_roles_gone(tmp_path: Path) -> None:
    clock = Clock()
    sizes = {10: 100.0, 11: 200.0}
    cpu = {10: 1.5, 11: 2.25}
    recorder = RssRecorder(tmp_path / RSS_FILE, interval_s=1.0, clock=clock, read=sizes.get, read_cpu=cpu.get)
    roles = [("oracle", 10), ("trainer-0", 11)]
    recorder.sample(roles)
    clock.now += 0.5
    recorder.sample(roles)  # too soon: nothing
    clock.now += 0.5
    del sizes[11], cpu[11]  # trainer-0 exited
    cpu[10] = 1.75
    recorder.sample(roles)
    assert read_rss(tmp_path) == [
        RssSample(time=1000.0, rss_mb={"oracle": 100.0, "trainer-0": 200.0},
                  cpu_s={"oracle": 1.5, "trainer-0": 2.25}),
        RssSample(time=1001.0, rss_mb={"oracle": 100.0}, cpu_s={"oracle": 1.75}),
    ]


def test_this_process_has_a_cpu_time_that_grows_and_a_reaped_one_has_none() -> None:
    before = read_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # spend CPU: 50 ms of it
        pass
    after = read_cpu_s(os.getpid())
    assert before is not None and after is not None and after - before >= 0.03
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert read_cpu_s(child.pid) is None


def test_a_line_cut_short_is_left_out_and_no_file_is_no_samples(tmp_path: Path) -> None:
    assert read_rss(tmp_path) == []
    (tmp_path / RSS_FILE).write_bytes(b'{"time": 1.0, "rss_mb": {"ps-0": 5.0}}\n{"time": 2.0, "rss_')
    assert read_rss(tmp_path) == [RssSample(time=1.0, rss_mb={"ps-0": 5.0})]  # no cpu_s: older files


def linear_run(growth_per_iteration: float) -> tuple[list[RssSample], np.ndarray, np.ndarray]:
    """Iterations 0..99 ending at t = 10.0, 10.1, ...; a sample every 0.25 s from t = 9 (start-up)
    to t = 22 (after training): the trainer grows linearly from 400 MB, the PS stays at 1 GB
    with a spike at the final save. The trainer spends 80 ms of CPU an iteration, the PS a
    quarter of a core (25 ms an iteration of 100 ms)."""
    iterations = np.arange(100)
    end_time = 10.0 + 0.1 * iterations
    samples = []
    for t in np.arange(9.0, 22.0, 0.25):
        done = int(np.searchsorted(end_time, t, side="right"))
        ps = 1500.0 if t > 21 else 1000.0
        samples.append(RssSample(time=float(t), rss_mb={"trainer-0": 400.0 + growth_per_iteration * done, "ps-0": ps},
                                 cpu_s={"trainer-0": 0.08 * done, "ps-0": 0.25 * t}))
    return samples, iterations, end_time


def test_samples_are_placed_on_the_iterations_every_trainer_had_done() -> None:
    samples, iterations, end_time = linear_run(0.0)
    curves = rss_curves(samples, iterations, end_time)
    assert list(curves) == ["ps-0", "trainer-0"]  # the launcher's order
    c = curves["trainer-0"]
    at = dict(zip(c.time.tolist(), c.done.tolist()))
    assert at[9.0] == 0 and at[10.0] == 1 and at[10.25] == 3 and at[19.9 - 0.15] == 98
    assert at[21.0] == 100
    assert c.training.tolist() == (c.time <= end_time[-1]).tolist()


def test_growth_is_the_fitted_slope_after_the_warm_up_and_the_peak_includes_the_final_saves() -> None:
    samples, iterations, end_time = linear_run(0.002)  # 2 MB per 1,000 iterations
    figures = summarise_rss(rss_curves(samples, iterations, end_time), warm_from=20, min_span=50)
    trainer, ps = figures["trainer-0"], figures["ps-0"]
    assert trainer.growth_mb_per_1k == pytest.approx(2.0)
    assert trainer.warm_mb == pytest.approx(400.0 + 0.002 * 21)  # the first sample at or after 20
    assert trainer.end_mb == pytest.approx(400.0 + 0.002 * 98)  # the last sample before 19.9 s
    assert ps.growth_mb_per_1k == pytest.approx(0.0, abs=1e-9)
    assert (ps.end_mb, ps.peak_mb) == (1000.0, 1500.0)
    assert trainer.cpu_ms_per_iter == pytest.approx(80.0)
    assert ps.cpu_ms_per_iter == pytest.approx(25.0, rel=0.05)  # samples fall between iterations
    text = format_rss(figures, 20)
    assert "after iteration 20" in text and "+2.00" in text and "1,500.0" in text and "80.0" in text


def test_cpu_time_can_stop_before_the_end_of_training() -> None:
    samples, iterations, end_time = linear_run(0.0)
    cpu = [RssSample(time=s.time, rss_mb=s.rss_mb, cpu_s={"trainer-0": 0.05 * min(d, 60) + 0.01 * max(d - 60, 0)})
           for s, d in ((s, int(np.searchsorted(end_time, s.time, side="right"))) for s in samples)]
    curves = rss_curves(cpu, iterations, end_time)
    assert summarise_rss(curves, warm_from=20, cpu_until=60)["trainer-0"].cpu_ms_per_iter == pytest.approx(50.0)
    whole = summarise_rss(curves, warm_from=20)["trainer-0"]
    assert 10.0 < whole.cpu_ms_per_iter < 50.0 and whole.end_mb == 400.0


def test_samples_without_cpu_time_give_none_per_iteration() -> None:
    samples, iterations, end_time = linear_run(0.0)
    old = [RssSample(time=s.time, rss_mb=s.rss_mb) for s in samples]  # a file from before
    figures = summarise_rss(rss_curves(old, iterations, end_time), warm_from=20)
    assert math.isnan(figures["trainer-0"].cpu_ms_per_iter)


def test_a_run_too_short_for_a_slope_says_so() -> None:
    # 78 iterations after the warm-up: extrapolated to 1,000 they would say nothing.
    samples, iterations, end_time = linear_run(0.002)
    figures = summarise_rss(rss_curves(samples, iterations, end_time), warm_from=20)
    assert math.isnan(figures["trainer-0"].growth_mb_per_1k)
    assert figures["trainer-0"].warm_mb > 0  # the other figures are there
    assert "n/a" in format_rss(figures, 20)


def test_points_are_thinned_to_a_limit_keeping_the_last() -> None:
    samples, iterations, end_time = linear_run(0.01)
    c = rss_curves(samples, iterations, end_time)["trainer-0"]
    points = c.points(limit=10)
    assert len(points) <= 11 and points[-1] == (int(c.done[-1]), round(float(c.rss_mb[-1]), 3))
    assert len(c.points()) == len(c.done)


def test_plot_rss_writes_a_png(tmp_path: Path) -> None:
    samples, iterations, end_time = linear_run(0.01)
    path = plot_rss(rss_curves(samples, iterations, end_time), 20, tmp_path / "memory.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)
