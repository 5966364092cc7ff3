"""Small sources written the way other tools write them: TorchRec npy days, parquet."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data.preprocessed import open_preprocessed
from common.data.raw import dense_transform
from common.errors import ConfigError
from tests.common.data.conftest import KAGGLE


@dataclass(frozen=True)
class Fields:
    """Raw Criteo fields of some rows: missing values are 0 in the arrays and True in the masks."""

    labels: np.ndarray  # int32 [n]
    dense: np.ndarray  # int64 [n, 13]
    dense_missing: np.ndarray
    ids: np.ndarray  # int64 [n, 26], the hex values as integers
    ids_missing: np.ndarray

    def rows(self, start: int, stop: int) -> Fields:
        parts = (self.labels, self.dense, self.dense_missing, self.ids, self.ids_missing)
        return Fields(*(a[start:stop] for a in parts))


def kaggle_lines(n: int) -> list[str]:
    return KAGGLE.read_text().splitlines()[:n]


def kaggle_fields(n: int) -> Fields:
    """The first `n` rows of the Kaggle sample, parsed field by field (a plain reference)."""
    rows = [line.split("\t") for line in kaggle_lines(n)]
    dense = [[int(x) if x else 0 for x in r[1:14]] for r in rows]
    ids = [[int(x, 16) if x else 0 for x in r[14:]] for r in rows]
    return Fields(
        labels=np.array([int(r[0]) for r in rows], dtype=np.int32),
        dense=np.array(dense, dtype=np.int64), dense_missing=np.array([[not x for x in r[1:14]] for r in rows]),
        ids=np.array(ids, dtype=np.int64), ids_missing=np.array([[not x for x in r[14:]] for r in rows]),
    )  # fmt: skip


def save_day(folder: Path, day: int, *, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray,
             sparse_name: str = "day_{n}_sparse.npy") -> None:  # fmt: skip
    """One day's three files, with np.save, as torchrec names them."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"day_{day}_labels.npy", labels)
    np.save(folder / f"day_{day}_dense.npy", dense)
    np.save(folder / sparse_name.format(n=day), sparse)


def torchrec_day(folder: Path, day: int, f: Fields) -> np.ndarray:
    """What torchrec's BinaryCriteoUtils.tsv_to_npys writes for these rows (its code, step by
    step); returns the dense block it stores."""
    dense_np = f.dense.astype(np.int32)
    dense_np -= dense_np.min() - 2
    dense_np = np.log(dense_np, dtype=np.float32)
    labels_np = f.labels.astype(np.int32).reshape((-1, 1))
    save_day(folder, day, labels=labels_np, dense=dense_np, sparse=f.ids.astype(np.int64))
    return dense_np


def our_dense(f: Fields) -> np.ndarray:
    """The dense features the raw reader makes of these fields."""
    return dense_transform(f.dense)


def write_parquet(path: Path, f: Fields, *, dense: str = "raw", row_group_size: int = 100) -> None:
    """NVTabular-style columns label, I1..I13, C1..C26; missing values are nulls. `dense`:
    "raw" counts as int64, or "transformed" float32 features (our transform)."""
    cols: dict[str, pa.Array] = {"label": pa.array(f.labels)}
    values = f.dense if dense == "raw" else our_dense(f)
    for j in range(13):
        cols[f"I{j + 1}"] = pa.array(values[:, j], mask=f.dense_missing[:, j] if dense == "raw" else None)
    for j in range(26):
        cols[f"C{j + 1}"] = pa.array(f.ids[:, j], mask=f.ids_missing[:, j])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


def assert_incomplete(out: Path) -> None:
    """A conversion that failed or stopped: what it wrote may be kept for the next run, but
    nothing takes it for a complete directory."""
    assert not (out / "manifest.json").exists()
    with pytest.raises(ConfigError, match="not a preprocessed data directory"):
        open_preprocessed(out)
