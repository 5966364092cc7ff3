"""Pushed rows (common/data/spool.py): a body is a part only once it is on disk whole and
read as the stream's format reads a file; a bad one is refused naming its line or row, and
leaves nothing behind."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data.live import LiveSource
from common.data.spec import DataSpec
from common.data.spool import Spool
from common.errors import BadRequest
from tests.common.data.test_live import SIZES, sample_lines, watch_spec


def test_a_body_becomes_a_part_in_sequence_and_the_stream_takes_it(tmp_path: Path) -> None:
    incoming = tmp_path / "in"
    incoming.mkdir()
    source = LiveSource(watch_spec(incoming), tmp_path / "log")
    lines = sample_lines(30)
    first = source.spool.accept("".join(lines[:10]).encode())
    second = source.spool.accept("".join(lines[10:30]).encode())
    assert (first.part, first.rows, second.part, second.rows) == (
        "ingest-000000000000.tsv", 10, "ingest-000000000001.tsv", 20)
    assert source.refresh() == 30
    assert [Path(p.path).name for p in source.parts] == [first.part, second.part]
    # a spool opened again goes on from the last sequence number
    assert Spool(source.spec, source.spool.folder).accept(lines[0].encode()).part == "ingest-000000000002.tsv"


@pytest.mark.parametrize(("body", "where"), [
    (b"", "empty body"),
    (b"1\t2\t3\n", "line 1"),
])
def test_a_bad_text_body_is_refused_naming_its_line_and_leaves_nothing(tmp_path: Path, body: bytes,
                                                                      where: str) -> None:
    spool = Spool(watch_spec(tmp_path / "in"), tmp_path / "spool")
    with pytest.raises(BadRequest, match=where):
        spool.accept(body)
    assert not spool.folder.exists() or list(spool.folder.iterdir()) == []


def test_a_bad_line_deep_in_a_body_is_named(tmp_path: Path) -> None:
    lines = sample_lines(50)
    lines[36] = "1\tx\n"
    spool = Spool(watch_spec(tmp_path / "in"), tmp_path / "spool")
    with pytest.raises(BadRequest, match=r"^line 37: ") as error:
        spool.accept("".join(lines).encode())
    assert error.value.fields["line"] == 37
    assert list(spool.folder.iterdir()) == []


def parquet_body(labels: list[float]) -> bytes:
    n = len(labels)
    table = pa.table({"label": labels, **{f"I{i}": np.arange(n, dtype=np.float32) for i in range(1, 14)},
                      **{f"C{i}": np.arange(n, dtype=np.int64) for i in range(1, 27)}})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def test_parquet_bodies_are_checked_row_by_row(tmp_path: Path) -> None:
    spec = DataSpec(format="parquet", path=str(tmp_path / "in" / "*.parquet"), table_sizes=tuple(SIZES),
                    hashing="none", watch=True, on_error="skip")
    spool = Spool(spec, tmp_path / "spool")
    assert spool.accept(parquet_body([0.0, 1.0, 1.0])).rows == 3
    with pytest.raises(BadRequest, match="row 1"):
        spool.accept(parquet_body([0.0, 0.5, 1.0]))
    with pytest.raises(BadRequest, match="not a parquet file"):
        spool.accept(b"PAR1 this is not parquet")
    assert [p.name for p in spool.parts()] == ["ingest-000000000000.parquet"]
