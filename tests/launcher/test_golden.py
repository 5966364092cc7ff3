"""What the launcher prints and writes for a fixed set of records, byte for byte.

The records are the trainer's (``tests/trainer/fixtures/run``: two trainers, 30 iterations,
a resume, checkpoints and evaluations; `tests/trainer/test_records.py` made them) and those
of an older trainer (``tests/trainer/fixtures/old-run``: no payload bytes by kind, no
compute CPU, a phase no longer timed, a null loss, a torn line, a kind this reader does not
know, an unfinished last line). The expected output in ``fixtures/golden`` was rendered by
`launcher.report` before it was split into summary, text, plots and progress; a change to
what a user sees must show up here as a deliberate edit of those files.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from launcher.progress import ProgressBar
from launcher.summary import summarise, write_report
from launcher.text import compare_bytes, compare_modes, format_summary
from trainer.records import read_run

TRAINER_FIXTURES = Path(__file__).resolve().parents[1] / "trainer" / "fixtures"
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden"
EXTRA = {"spec": "examples/local.toml", "seconds": 3.25, "rss": [{"role": "oracle", "peak_mb": 247.4}]}


def summaries() -> dict:
    run = read_run(TRAINER_FIXTURES / "run", 2)
    old = read_run(TRAINER_FIXTURES / "old-run", 1)
    return {
        "bagpipe": summarise(run, mode="bagpipe", global_batch=256, warmup=3, trainers=2),
        "local": summarise(old, mode="local", global_batch=64, warmup=2, trainers=1, loss_window=5),
        "no-cache": summarise(run, mode="no-cache", global_batch=256, warmup=5, cooldown=4, trainers=2),
    }


def rendered_text() -> str:
    """Every table the launcher and the benchmarks print from these summaries."""
    s = summaries()
    parts = [format_summary(summary) for summary in s.values()]
    parts += [compare_modes(s), compare_bytes(s)]
    return "\n\n".join(parts) + "\n"


def progress_lines(caplog: pytest.LogCaptureFixture) -> str:
    """The lines the progress bar logs off a terminal, fed each trainer's records in turn."""
    run = read_run(TRAINER_FIXTURES / "run", 2)
    clock = iter(float(i) for i in range(1000))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        with ProgressBar(30, "golden", trainers=2, file=io.StringIO(), clock=lambda: next(clock)) as bar:
            for start in range(0, 45, 5):
                bar.update({j: records[start:start + 5] for j, records in run.items()})
    return "".join(r.getMessage() + "\n" for r in caplog.records if r.getMessage().startswith("golden"))


def test_the_printed_summaries_and_tables_are_as_before() -> None:
    assert rendered_text() == (GOLDEN / "summary.txt").read_text()


def test_report_json_is_as_before(tmp_path: Path) -> None:
    for name, summary in summaries().items():
        (tmp_path / name).mkdir()
        written = write_report(tmp_path / name, summary, EXTRA)
        assert written.read_bytes() == (GOLDEN / f"report-{name}.json").read_bytes(), name


def test_the_progress_lines_are_as_before(caplog: pytest.LogCaptureFixture) -> None:
    assert progress_lines(caplog) == (GOLDEN / "progress.txt").read_text()
