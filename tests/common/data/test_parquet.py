from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data import parquet
from common.data.__main__ import main
from common.data.chunks import MalformedData
from common.data.convert import convert
from common.data.dataset import open_dataset
from common.data.hashing import MISSING
from common.data.parquet import ParquetReader
from common.data.spec import DataSpec
from common.errors import ConfigError
from tests.common.data.sources import assert_incomplete, kaggle_fields, our_dense, write_parquet


def small_table(**columns: pa.Array) -> pa.Table:
    """40 rows of custom columns: click, two dense, three ids (< 50); `columns` replace some."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (3, 40))
    return pa.table({
        "click": pa.array(rng.integers(0, 2, 40).astype(np.int8)), "price": pa.array(rng.random(40).astype(np.float32)),
        "age": pa.array(rng.integers(0, 90, 40)), "user": pa.array(ids[0]), "item": pa.array(ids[1].astype(np.int32)),
        "shop": pa.array(ids[2].astype(np.uint16)), **columns,
    })  # fmt: skip


def one_bad(at: int, value: object, fill: object = 1, type: pa.DataType | None = None) -> pa.Array:
    """A 40-row column of `fill` with `value` at row `at`."""
    return pa.array([fill] * at + [value] + [fill] * (39 - at), type)


def small_spec(path: Path, **fields: object) -> DataSpec:
    return DataSpec(format="parquet", path=str(path), label_column="click", dense_columns=("price", "age"),
                    sparse_columns=("user", "item", "shop"), hashing="none", table_sizes=(50, 50, 50),
                    **fields)  # type: ignore[arg-type]  # fmt: skip


def test_nvtabular_folder_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """part_2 before part_10; NVTabular's side files ignored; never more than CHUNK_ROWS rows read at once."""
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 16)
    f = kaggle_fields(300)
    for i, (a, b) in zip((2, 10), [(0, 120), (120, 300)], strict=True):
        write_parquet(tmp_path / f"part_{i}.parquet", f.rows(a, b), dense="transformed", row_group_size=50)
    pq.write_metadata(pq.read_schema(tmp_path / "part_2.parquet"), tmp_path / "_metadata")
    (tmp_path / "schema.pbtxt").write_text("feature {}\n")
    reader = ParquetReader(DataSpec(format="parquet", path=str(tmp_path)))
    chunks = list(reader.chunks())
    assert [p.name for p in reader.files] == ["part_2.parquet", "part_10.parquet"]
    assert max(len(c) for c in chunks) == 16 and reader.rows == 300
    np.testing.assert_array_equal(np.concatenate([c.labels for c in chunks]), f.labels)
    np.testing.assert_array_equal(np.concatenate([c.dense for c in chunks]), our_dense(f))
    want = f.ids.astype(np.uint64)
    want[f.ids_missing] = MISSING
    np.testing.assert_array_equal(np.concatenate([c.ids for c in chunks]), want)


def test_custom_columns_ids_as_rows(tmp_path: Path) -> None:
    table = small_table(user=pa.array([3, None] * 20), click=pa.array([True, False] * 20))
    pq.write_table(table, tmp_path / "t.parquet")
    data = open_dataset(small_spec(tmp_path / "t.parquet"))
    rows = data.rows(0, 40)
    assert data.table_sizes == (50, 50, 50) and data.num_dense == 2
    np.testing.assert_array_equal(rows.sparse[:, 0], [3, 0] * 20)  # a null id is the missing row
    np.testing.assert_array_equal(rows.sparse[:, 2], table.column("shop").to_numpy())
    np.testing.assert_array_equal(rows.labels, [1.0, 0.0] * 20)
    np.testing.assert_array_equal(rows.dense[:, 1], table.column("age").to_numpy().astype(np.float32))


# case -> (columns replaced in the second file, or one dropped; row named; message)
BAD_TABLES = {
    "missing column": ({"drop": "age"}, None, "has no column 'age' (data.dense_columns)"),
    "string ids": ({"item": pa.array(["a"] * 40)}, None, "column 'item' is string: categorical columns must hold integer"),
    "string label": ({"click": pa.array(["1"] * 40)}, None, "column 'click' is string"),
    "null label": ({"click": one_bad(7, None)}, 7, "bad click value: missing (must be 0 or 1)"),
    "NaN label": ({"click": one_bad(9, np.nan, 1.0)}, 9, "bad click value nan (must be 0 or 1)"),
    "label 2": ({"click": one_bad(39, 2)}, 39, "bad click value 2"),
    "negative id": ({"user": one_bad(25, -4)}, 25, "bad user value -4 (ids must be >= 0"),
    "id past table": ({"shop": one_bad(30, 50, type=pa.uint16())}, 30, "bad shop value 50 (must be below 50"),
    "uint64 past 2**63": ({"user": one_bad(5, 2**64 - 1, type=pa.uint64())}, 5, f"bad user value {2**64 - 1}"),
    "NaN dense": ({"price": one_bad(12, np.nan, 0.5, pa.float32())}, 12, "bad price value nan (must be a finite"),
    "inf dense": ({"price": one_bad(0, 1e300, 0.5)}, 0, "bad price value 1e+300 (must be a finite number)"),
    "null dense": ({"age": one_bad(3, None, 30)}, 3, "bad age value: missing (dense_transform = 'none'"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_TABLES)
def test_bad_file_names_file_row_and_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 8)  # rows are numbered across batches
    change, row, message = BAD_TABLES[case]
    good = small_table()
    pq.write_table(good, tmp_path / "part_0.parquet")
    bad = good.drop_columns([change["drop"]]) if "drop" in change else small_table(**change)
    pq.write_table(bad, tmp_path / "part_1.parquet", row_group_size=16)
    with pytest.raises(MalformedData) as info:
        convert(small_spec(tmp_path), tmp_path / "out", progress=False)
    assert info.value.path == tmp_path / "part_1.parquet" and info.value.row == row and message in str(info.value)
    assert_incomplete(tmp_path / "out")
    with pytest.raises(MalformedData) as read:  # read in place: the same error, when its row is read
        data = open_dataset(small_spec(tmp_path))
        data.rows(0, data.num_rows)
    assert str(read.value) == str(info.value)


def test_raw_counts_with_log1p_and_skip_mode(tmp_path: Path) -> None:
    age = pa.array([30] * 3 + [None, -2] + [30] * 35)
    pq.write_table(small_table(age=age, click=pa.array([0] * 39 + [7])), tmp_path / "t.parquet")
    reader = ParquetReader(small_spec(tmp_path / "t.parquet", dense_transform="log1p", on_error="skip"))
    (chunk,) = reader.chunks()
    assert reader.skipped == 1 and len(chunk) == 39
    np.testing.assert_array_equal(chunk.dense[:5, 1], np.log1p(np.float32([30, 30, 30, 0, 0])))


def test_not_parquet_and_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("label,I1\n")
    with pytest.raises(MalformedData, match="x.parquet: is not a readable parquet file"):
        ParquetReader(DataSpec(format="parquet", path=str(tmp_path)))
    (tmp_path / "x.parquet").unlink()
    with pytest.raises(ConfigError, match="holds no .parquet files"):
        ParquetReader(DataSpec(format="parquet", path=str(tmp_path)))


def test_cli_convert_with_column_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(small_table(), tmp_path / "t.parquet")
    code = main(["convert", "--format", "parquet", "--path", str(tmp_path / "t.parquet"), "--label-column", "click",
                 "--dense-columns", "price,age", "--sparse-columns", "user,item,shop", "--hashing", "none",
                 "--table-sizes", "50,50,50", "--dense-transform", "log1p", "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 0 and "40 rows, 3 tables, 2 dense" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["config"]["sparse_columns"] == ["user", "item", "shop"]
    assert manifest["config"]["dense_transform"] == "log1p" and len(manifest["source"]["checksum"]) == 32
