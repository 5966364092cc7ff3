from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from common.data import npy
from common.data.__main__ import main
from common.data.chunks import MalformedData
from common.data.convert import convert
from common.data.dataset import access, cache_path, open_dataset
from common.data.hashing import MISSING
from common.data.npy import NpyDaysReader
from common.data.raw import RawReader
from common.data.spec import DataSpec
from common.errors import ConfigError
from tests.common.data.conftest import KAGGLE
from tests.common.data.sources import assert_incomplete, kaggle_fields, save_day, torchrec_day


def read_all(spec: DataSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, NpyDaysReader]:
    reader = NpyDaysReader(spec)
    chunks = list(reader.chunks())
    return (*(np.concatenate([getattr(c, k) for c in chunks]) for k in ("labels", "dense", "ids")), reader)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16 rows, so rows are numbered across chunk boundaries."""
    monkeypatch.setattr(npy, "CHUNK_ROWS", 16)


def test_reads_what_torchrec_tsv_to_npys_writes(tmp_path: Path, small_chunks: None) -> None:
    f = kaggle_fields(500)
    stored = [torchrec_day(tmp_path, 0, f.rows(0, 300)), torchrec_day(tmp_path, 1, f.rows(300, 500))]
    labels, dense, ids, reader = read_all(DataSpec(format="criteo-npy", path=str(tmp_path)))
    raw = next(RawReader(DataSpec(format="criteo", path=str(KAGGLE))).chunks())
    assert reader.rows == 500
    assert [p.name for p in reader.files[:3]] == ["day_0_labels.npy", "day_0_dense.npy", "day_0_sparse.npy"]
    np.testing.assert_array_equal(labels, raw.labels[:500])
    np.testing.assert_array_equal(ids, raw.ids[:500])  # hex values, missing (0) as MISSING
    assert (ids == MISSING).any()
    np.testing.assert_array_equal(dense, np.concatenate(stored))  # torchrec's transform, as stored


def test_contiguous_ids_are_rows_with_hashing_none(tmp_path: Path) -> None:
    """sparse_to_contiguous output (ids 2, 3, ... per column) in its own folder."""
    f = kaggle_fields(200)
    contig = np.stack([np.unique(f.ids[:, t], return_inverse=True)[1] + 2 for t in range(26)], axis=1)
    save_day(tmp_path / "days", 0, labels=f.labels.reshape(-1, 1), dense=np.zeros((200, 13), np.float32),
             sparse=contig, sparse_name="day_{n}_sparse_contig_freq.npy")  # fmt: skip
    (tmp_path / "days" / "day_0_sparse_contig_freq.npy").rename(tmp_path / "contig.npy")
    (tmp_path / "contig").mkdir()
    (tmp_path / "contig.npy").rename(tmp_path / "contig" / "day_0_sparse_contig_freq.npy")
    sizes = tuple(int(n) + 1 for n in contig.max(axis=0))
    spec = DataSpec(format="criteo-npy", path=str(tmp_path / "days"), sparse_path=str(tmp_path / "contig"),
                    hashing="none", table_sizes=sizes)  # fmt: skip
    data = open_dataset(spec)
    assert data.table_sizes == sizes
    np.testing.assert_array_equal(data.rows(0, 200).sparse, contig)
    too_small = DataSpec(format="criteo-npy", path=str(tmp_path / "days"), sparse_path=str(tmp_path / "contig"),
                         hashing="none", table_sizes=(sizes[0] - 1, *sizes[1:]))  # fmt: skip
    with pytest.raises(MalformedData, match=f"bad C1 value {sizes[0] - 1} \\(must be below {sizes[0] - 1}"):
        open_dataset(too_small).rows(0, 200)  # read in place: checked as read


Day = dict[str, np.ndarray]


def _set(day: Day, part: str, value: np.ndarray) -> Day:
    return {**day, part: value}


def _poke(part: str, where: tuple[int, ...], value: float) -> Callable[[Day], Day]:
    def damage(day: Day) -> Day:
        a = day[part].copy()
        a[where] = value
        return _set(day, part, a)

    return damage


def _float_labels(day: Day) -> Day:
    return _set(day, "labels", day["labels"].astype(np.float32))


# case -> (damage to day 1 of two 40-row days, file named, row named, message)
BAD_DAYS = {
    "dense dtype": (lambda d: _set(d, "dense", d["dense"].astype(np.int32)), "dense", None, "holds int32 [40, 13]"),
    "sparse dtype": (lambda d: _set(d, "sparse", d["sparse"].astype(np.float64)), "sparse", None, "holds float64"),
    "dense shape": (lambda d: _set(d, "dense", d["dense"][:, :12]), "dense", None, "[40, 12]; torchrec writes float32"),
    "labels shape": (lambda d: _set(d, "labels", np.zeros((40, 2), np.int32)), "labels", None, "[40, 2]"),
    "row counts": (lambda d: _set(d, "sparse", d["sparse"][:39]), "sparse", None, "has 39 rows, day_1_labels.npy has 40"),
    "negative id": (_poke("sparse", (21, 3), -5), "sparse", 21, "bad C4 value -5 (ids must be >= 0"),
    "NaN label": (lambda d: _poke("labels", (17, 0), np.nan)(_float_labels(d)), "labels", 17, "bad label value nan"),
    "test-set label": (_poke("labels", (0, 0), -1), "labels", 0, "bad label value -1"),
    "NaN dense": (_poke("dense", (33, 1), np.nan), "dense", 33, "bad I2 value nan (must be finite)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_DAYS)
def test_bad_day_names_file_and_row(tmp_path: Path, small_chunks: None, case: str) -> None:
    damage, part, row, message = BAD_DAYS[case]
    f = kaggle_fields(80)
    save_day(tmp_path, 0, labels=f.labels[:40].reshape(-1, 1), dense=np.ones((40, 13), np.float32), sparse=f.ids[:40])
    day: Day = {"labels": f.labels[40:].reshape(-1, 1), "dense": np.ones((40, 13), np.float32), "sparse": f.ids[40:]}
    save_day(tmp_path, 1, **damage(day))
    spec = DataSpec(format="criteo-npy", path=str(tmp_path))
    with pytest.raises(MalformedData) as info:
        convert(spec, tmp_path / "out", progress=False)
    assert info.value.path == tmp_path / f"day_1_{part}.npy" and info.value.row == row and message in str(info.value)
    assert_incomplete(tmp_path / "out")
    with pytest.raises(MalformedData) as read:  # read in place: the same error, when its row is read
        data = open_dataset(spec)
        data.rows(0, data.num_rows)
    assert (read.value.path, read.value.row, str(read.value)) == (info.value.path, row, str(info.value))


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    f = kaggle_fields(10)
    save_day(tmp_path, 0, labels=f.labels.reshape(-1, 1), dense=np.ones((10, 13), np.float32), sparse=f.ids)
    spec = DataSpec(format="criteo-npy", path=str(tmp_path))
    sparse = tmp_path / "day_0_sparse.npy"
    sparse.write_bytes(sparse.read_bytes()[:-8])
    with pytest.raises(MalformedData, match="day_0_sparse.npy: is not a readable .npy array"):
        NpyDaysReader(spec)
    np.save(sparse, np.array([{"a": 1}] * 10, dtype=object))  # a pickle: refused, never loaded
    with pytest.raises(MalformedData, match="not a readable .npy array"):
        NpyDaysReader(spec)
    sparse.unlink()
    with pytest.raises(ConfigError, match="day 0 needs one sparse file") as info:
        NpyDaysReader(spec)
    assert info.value.field == "data.path"
    np.save(sparse, f.ids)
    np.save(tmp_path / "day_0_sparse_contig_freq.npy", f.ids)
    with pytest.raises(ConfigError, match="found day_0_sparse.npy, day_0_sparse_contig_freq.npy"):
        NpyDaysReader(spec)
    (tmp_path / "day_0_sparse_contig_freq.npy").unlink()
    (tmp_path / "day_0_dense.npy").rename(tmp_path / "day_0_dense.bak")
    with pytest.raises(ConfigError, match="day_0_dense.npy is missing"):
        NpyDaysReader(spec)
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    with pytest.raises(ConfigError, match="holds no day_N_dense.npy"):
        NpyDaysReader(spec)


def test_skip_mode_drops_and_counts_bad_rows(tmp_path: Path, small_chunks: None) -> None:
    f = kaggle_fields(50)
    sparse = f.ids.copy()
    sparse[[3, 20, 20], [0, 5, 6]] = -1
    labels = f.labels.reshape(-1, 1).copy()
    labels[40] = 2
    save_day(tmp_path, 0, labels=labels, dense=np.ones((50, 13), np.float32), sparse=sparse)
    got_labels, _, ids, reader = read_all(DataSpec(format="criteo-npy", path=str(tmp_path), on_error="skip"))
    keep = np.setdiff1d(np.arange(50), [3, 20, 40])
    assert reader.skipped == 3 and reader.rows == 47
    np.testing.assert_array_equal(got_labels, f.labels[keep])
    want = f.ids[keep].astype(np.uint64)
    want[f.ids_missing[keep]] = MISSING
    np.testing.assert_array_equal(ids, want)


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torchrec_day(tmp_path / "days", 0, kaggle_fields(30))
    args = ["convert", "--format", "criteo-npy", "--path", str(tmp_path / "days"), "--out"]
    assert main([*args, str(tmp_path / "o")]) == 0
    assert "30 rows, 26 tables, 13 dense" in capsys.readouterr().out
    np.save(tmp_path / "days" / "day_0_labels.npy", np.full((30, 1), 3, np.int32))
    assert main([*args, str(tmp_path / "p")]) == 2
    assert "day_0_labels.npy: row 0: bad label value 3" in capsys.readouterr().err


def test_days_are_read_in_place(tmp_path: Path) -> None:
    """No copy: nothing is written beside the days, and a day added is read at once."""
    f = kaggle_fields(60)
    torchrec_day(tmp_path / "days", 0, f.rows(0, 40))
    spec = DataSpec(format="criteo-npy", path=str(tmp_path / "days"))
    assert access(spec) == "in place" and open_dataset(spec).num_rows == 40
    torchrec_day(tmp_path / "days", 1, f.rows(40, 60))
    assert open_dataset(spec).num_rows == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["days"] and not cache_path(spec).exists()
    assert access(dataclasses.replace(spec, on_error="skip")) == "converted"  # skipping moves later rows
    assert access(dataclasses.replace(spec, hashing="dictionary")) == "converted"  # a pass over all first
