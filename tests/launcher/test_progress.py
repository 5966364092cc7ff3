"""The progress bar (`launcher.progress`): on a terminal, and as log lines off one."""

from __future__ import annotations

import io
import logging
import math

import pytest

from launcher.progress import ProgressBar, remaining_seconds
from tests.launcher.factories import it_rec
from trainer.records import Record


def test_progress_bar_logs_every_tenth_when_not_a_terminal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = iter(float(i) for i in range(1000))
    bar = ProgressBar(20, "bagpipe", trainers=2, file=io.StringIO(), clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="launcher.progress"):
        bar.update({0: [it_rec(0, 1.0), it_rec(1, 2.0)]})
        assert bar.done == 0 and caplog.records == []  # trainer 1 has done nothing yet
        bar.update({1: [it_rec(0, 1.0), it_rec(1, 2.0)]})
        assert bar.done == 2
        bar.update({0: [it_rec(2, 3.0)], 1: []})
        bar.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # 10 % once, then the closing line
    assert messages[0].startswith("bagpipe: 2/20 iterations (10%), 200 samples/s, loss 0.5000")
    assert "hit 50.0 %" in messages[0] and "ETA" in messages[0]


def test_progress_bar_draws_on_a_terminal_stream() -> None:
    out = io.StringIO()
    with ProgressBar(4, "run", file=out, enabled=True) as bar:
        bar.update({0: [it_rec(0, 1.0), it_rec(1, 1.5, samples=50)]})
    text = out.getvalue()
    assert "run" in text and "2/4" in text and "100 samples/s" in text and "hit 50.0 %" in text


def test_remaining_seconds_go_at_the_pace_of_the_recent_iterations() -> None:
    assert remaining_seconds([100.0, 100.1, 100.2, 100.3], 10) == pytest.approx(1.0)  # 0.1 s each
    assert remaining_seconds([5.0, 7.0], 0) == 0.0
    assert math.isnan(remaining_seconds([100.0], 10))  # one end: no pace yet
    assert math.isnan(remaining_seconds([], 10))


def _started_late(trainer_records: int) -> dict[int, list[Record]]:
    """Two trainers whose first iteration ended a minute after the launch (start-up), the
    next ones 0.1 s apart."""
    return {j: [it_rec(i, 60.0 + 0.1 * i) for i in range(trainer_records)] for j in range(2)}


def test_progress_eta_leaves_the_start_up_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = iter([0.0, 60.3, 60.3])  # the bar was made at launch; 4 of 20 iterations took 60.3 s
    bar = ProgressBar(20, "run", trainers=2, file=io.StringIO(), clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="launcher.progress"):
        bar.update(_started_late(4))
    assert caplog.records[0].getMessage().endswith(", ETA 00:01"), caplog.records[0].getMessage()  # 16 x 0.1 s


def test_progress_bar_shows_its_own_eta_only() -> None:
    out = io.StringIO()
    with ProgressBar(20, "run", trainers=2, file=out, enabled=True) as bar:
        bar.update(_started_late(4))
    text = out.getvalue()
    assert "4/20" in text and "ETA 00:01" in text, text
    assert "<" not in text and "it/s" not in text, text  # tqdm's ETA and rate count the start-up in
