"""The converter's progress bar ends where bad data stopped it."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from common.data.chunks import MalformedData
from common.data.convert import convert
from common.data.spec import DataSpec
from tests.common.data.conftest import KAGGLE
from tests.common.data.test_parquet import one_bad, small_spec, small_table


@pytest.mark.parametrize(("hashing", "bar"), [("hash", "convert"), ("dictionary", "count")])
@pytest.mark.parametrize("bad", ["2", "1\textra"], ids=["bad-label", "extra-field"])
def test_the_bar_stops_at_the_malformed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hashing: str, bar: str, bad: str
) -> None:
    lines = KAGGLE.read_text().splitlines()[:2000]
    lines[1199] = bad + lines[1199][1:]  # line 1,200 of 2,000
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MalformedData, match=r"bad\.tsv:1200: "):
        convert(DataSpec(format="criteo", path=str(path), hashing=hashing), tmp_path / "out", progress=True)
    before = len("\n".join(lines[:1199]) + "\n")
    last_drawn = capsys.readouterr().err.split("\r")[-1]
    assert last_drawn.startswith(f"{bar}:  {round(100 * before / path.stat().st_size)}%|"), last_drawn


def test_a_gzip_bar_stops_near_the_malformed_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In compressed bytes: exact up to what the decompressor read ahead (a few KiB)."""
    lines = KAGGLE.read_text().splitlines()[:2000]
    lines[1199] = "2" + lines[1199][1:]
    path = tmp_path / "bad.tsv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(MalformedData, match=r"bad\.tsv\.gz:1200: "):
        convert(DataSpec(format="criteo", path=str(path)), tmp_path / "out", progress=True)
    percent = int(capsys.readouterr().err.split("\r")[-1].split("%")[0].split()[-1])
    assert 55 <= percent <= 70, percent  # 60 % of the lines


def test_a_bad_parquet_row_stops_the_bar_at_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A parquet (or npy) error names a row, not a line: the bar ends where its file starts."""
    pq.write_table(small_table(), tmp_path / "part_0.parquet")
    pq.write_table(small_table(click=one_bad(7, None)), tmp_path / "part_1.parquet")
    with pytest.raises(MalformedData, match=r"part_1\.parquet: row 7: "):
        convert(small_spec(tmp_path), tmp_path / "out", progress=True)
    first, second = ((tmp_path / f"part_{i}.parquet").stat().st_size for i in (0, 1))
    last_drawn = capsys.readouterr().err.split("\r")[-1]
    assert last_drawn.startswith(f"convert:  {round(100 * first / (first + second))}%|"), last_drawn
