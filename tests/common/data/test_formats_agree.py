"""The same rows as raw TSV, as TorchRec npy days and as parquet give identical batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.data.dataset import Dataset, open_dataset
from common.data.spec import DataSpec
from tests.common.data.sources import kaggle_fields, kaggle_lines, our_dense, save_day, write_parquet

ROWS = 600


def write_all(tmp: Path) -> dict[str, dict]:
    """The first ROWS Kaggle rows in three formats, each split in two files; returns spec fields."""
    (tmp / "tsv").mkdir()
    (tmp / "tsv" / "part_0.tsv").write_text("\n".join(kaggle_lines(ROWS)[:350]) + "\n")
    (tmp / "tsv" / "part_1.tsv").write_text("\n".join(kaggle_lines(ROWS)[350:]) + "\n")
    f = kaggle_fields(ROWS)
    for day, (a, b) in enumerate([(0, 350), (350, ROWS)]):
        # torchrec's layout and dtypes; the dense block holds our transform of the counts
        # (torchrec's own, log(x - min + 2), is checked in test_npy) so rows can match.
        part = f.rows(a, b)
        save_day(tmp / "npy", day, labels=part.labels.reshape(-1, 1), dense=our_dense(part), sparse=part.ids)
        write_parquet(tmp / "parquet" / f"part_{day}.parquet", part, dense="raw", row_group_size=64)
    return {
        "criteo": {"path": str(tmp / "tsv")},
        "criteo-npy": {"path": str(tmp / "npy")},
        "parquet": {"path": str(tmp / "parquet"), "dense_transform": "log1p"},
    }


def batches(data: Dataset) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = [(b.labels, b.dense, b.sparse) for b in data.train_batches(64)]
    return out + [(b.labels, b.dense, b.sparse) for b in data.eval_batches(64)]


@pytest.mark.parametrize("hashing", ["hash", "dictionary"])
def test_tsv_npy_and_parquet_give_identical_batches(tmp_path: Path, hashing: str) -> None:
    sources = write_all(tmp_path)
    got = {}
    for fmt, fields in sources.items():
        spec = DataSpec(format=fmt, hashing=hashing, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"), **fields)
        data = open_dataset(spec)
        assert (data.num_rows, data.num_dense, len(data.table_sizes)) == (ROWS, 13, 26)
        got[fmt] = (data.table_sizes, batches(data))
    sizes, want = got["criteo"]
    assert len(want) == 540 // 64 + 1 and want[0][2].max() > 0
    for fmt in ("criteo-npy", "parquet"):
        assert got[fmt][0] == sizes, fmt
        for mine, theirs in zip(got[fmt][1], want, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b, err_msg=fmt)
