from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.data.__main__ import main
from common.data.stats import format_table, skew_stats
from tests.common.data.conftest import AVAZU, KAGGLE


def test_hand_computed_example() -> None:
    # batch size 2: iterations 0,0,1,1,2,2,3 ; table 0 rows
    t0 = np.array([5, 5, 1, 2, 5, 1, 5])
    chunks = [np.stack([t0, np.zeros(7, int)], axis=1)[:3], np.stack([t0, np.zeros(7, int)], axis=1)[3:]]
    report = skew_stats(chunks, (10, 3), batch_size=2, names=["a", "b"])
    a, b = report.tables
    assert (a.accesses, a.distinct, a.seen_once) == (7, 3, 1)
    assert a.top_share["1%"] == pytest.approx(4 / 7) and a.top_share["10%"] == pytest.approx(4 / 7)
    # uses of 5: it 0 (twice, counted once), 2, 3 -> distances 2, 1; of 1: it 1, 2 -> 1
    assert a.reuses == 3 and a.reuse_percentiles["p50"] == 1 and a.reuse_percentiles["p99"] == 2
    assert (b.distinct, b.reuses, b.reuse_percentiles["p90"]) == (1, 3, 1)
    assert report.overall.distinct == 4 and report.overall.accesses == 14
    assert report.reuse_histogram == {"1": 5, "2-3": 1}
    assert "overall" in format_table(report)


def test_cli_stats_on_kaggle_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["stats", "--format", "criteo", "--path", str(KAGGLE), "--cache-dir", str(tmp_path),
                 "--batch-size", "256", "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "s.json").read_text())
    overall = report["overall"]
    # README: top 1% of distinct pairs cover 62%, top 10% cover 79% (hashing merges a few).
    assert overall["top_share"]["1%"] == pytest.approx(0.62, abs=0.02)
    assert overall["top_share"]["10%"] == pytest.approx(0.79, abs=0.02)
    assert overall["accesses"] == 8000 * 26 and len(report["tables"]) == 26
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "C26" in capsys.readouterr().out


def test_cli_synth_then_convert_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "--out", str(tmp_path / "syn"), "--rows", "1000", "--num-tables", "4"]) == 0
    manifest = json.loads((tmp_path / "syn" / "manifest.json").read_text())
    assert manifest["rows"] == 1000 and manifest["table_sizes"] == [1460, 583, 10131227, 2202608]
    assert main(["convert", "--format", "criteo", "--path", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "data.path" in capsys.readouterr().err


def test_columns_align_whatever_the_table_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--format", "avazu", "--path", str(AVAZU), "--cache-dir", str(tmp_path),
                 "--batch-size", "16"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    head, rule, *rows = lines[next(i for i, line in enumerate(lines) if line.startswith("table ")):]
    assert rule == "-" * len(head), (head, rule)
    assert any(row.startswith("device_conn_type ") for row in rows), rows
    assert {len(row) for row in rows} == {len(head)}, "\n".join([head, *rows])
