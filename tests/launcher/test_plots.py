"""The plots (`launcher.plots`) are written as PNGs, atomically."""

from __future__ import annotations

from pathlib import Path

from launcher.plots import plot_modes, plot_run
from tests.launcher.factories import summary_of, two_trainer_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_plot_run_writes_three_pngs(tmp_path: Path) -> None:
    paths = plot_run(tmp_path, two_trainer_run())
    assert [p.name for p in paths] == ["throughput.png", "breakdown.png", "loss.png"]
    for p in paths:
        _assert_png(p)
    assert not list(tmp_path.glob("*.tmp"))


def test_plot_modes_writes_a_png(tmp_path: Path) -> None:
    path = plot_modes({"bagpipe": summary_of("bagpipe", 3000.0, 0.9, 0.5e6, 0.25e6),
                       "no-cache": summary_of("no-cache", 1000.0, 0.0, 5e6, 0.0)},
                      tmp_path / "modes.png")
    _assert_png(path)
