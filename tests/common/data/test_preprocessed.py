from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from common.data import dataset
from common.data.convert import Conversion, convert
from common.data.dataset import cache_path, open_dataset
from common.data.hashing import hash_rows
from common.data.preprocessed import open_preprocessed
from common.data.raw import MalformedData, RawReader
from common.data.spec import DataSpec
from common.errors import ConfigError
from tests.common.data.conftest import AVAZU, KAGGLE
from tests.common.data.sources import assert_incomplete


@pytest.fixture(scope="module")
def kaggle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "kaggle"
    convert(DataSpec(format="criteo", path=str(KAGGLE)), out, progress=False)
    return out


def test_round_trip_raw_to_batches(kaggle_dir: Path) -> None:
    spec = DataSpec(format="criteo", path=str(KAGGLE))
    raw = next(RawReader(spec).chunks())
    expected = np.stack([hash_rows(raw.ids[:, t], t, n) for t, n in enumerate(spec.table_sizes)], axis=1)
    data = open_dataset(DataSpec(format="preprocessed", path=str(kaggle_dir), eval_fraction=0.1))
    assert data.num_train_rows == 7200 and data.table_sizes == spec.table_sizes and data.num_dense == 13
    batches = list(data.train_batches(1000))
    assert [b.index for b in batches] == list(range(7))
    got = np.concatenate([b.sparse for b in batches])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected[:7000])
    np.testing.assert_array_equal(np.concatenate([b.dense for b in batches]), raw.dense[:7000])
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), raw.labels[:7000])
    evals = list(data.eval_batches(300))
    assert [len(b.labels) for b in evals] == [300, 300, 200]
    np.testing.assert_array_equal(evals[-1].sparse, expected[-200:])
    manifest = json.loads((kaggle_dir / "manifest.json").read_text())
    assert manifest["rows"] == 8000 and manifest["config"]["hashing"] == "hash"
    assert len(manifest["source"]["checksum"]) == 32 and [p["rows"] for p in manifest["parts"]] == [8000]


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_damaged_directory_is_refused(kaggle_dir: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(kaggle_dir, copy)
    (part,) = (copy / "parts").glob("*/*")
    if damage == "truncate":
        (part / "sparse.i32").write_bytes((part / "sparse.i32").read_bytes()[:-4])
        match = "sparse.i32 has 831996 bytes, the manifest promises 832000"
    elif damage == "delete":
        (part / "labels.f32").unlink()
        match = "labels.f32 is missing"
    else:
        (copy / "manifest.json").unlink()
        match = "not a preprocessed data directory"
    with pytest.raises(ConfigError, match=match):
        open_preprocessed(copy)


def test_wrong_sizes_are_refused(kaggle_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        open_dataset(DataSpec(format="preprocessed", path=str(kaggle_dir), table_sizes=(10,) * 26))
    assert info.value.field == "data.table_sizes"


def test_failed_conversion_leaves_nothing_complete(tmp_path: Path) -> None:
    lines = KAGGLE.read_text().splitlines()[:50]
    lines[40] = lines[40].replace("\t", "\tbad", 1)
    (tmp_path / "bad.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(MalformedData, match="bad.tsv:41"):
        convert(DataSpec(format="criteo", path=str(tmp_path / "bad.tsv")), tmp_path / "out", progress=False)
    assert_incomplete(tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.f32"))  # the bad piece's part was never written


def test_a_read_only_data_folder_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even for root, who may write anywhere: the conversion goes under ~/.cache instead."""
    shared = tmp_path / "shared"
    shared.mkdir()
    src = shared / "small.tsv"
    src.write_text("\n".join(KAGGLE.read_text().splitlines()[:50]) + "\n")
    shared.chmod(0o555)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    try:
        assert open_dataset(DataSpec(format="criteo", path=str(src))).num_rows == 50
        assert sorted(p.name for p in shared.iterdir()) == ["small.tsv"]
        assert cache_path(DataSpec(format="criteo", path=str(src))).is_relative_to(tmp_path / "home" / ".cache" / "bagpipe")
    finally:
        shared.chmod(0o755)


def test_raw_dataset_uses_and_refreshes_its_cache(tmp_path: Path) -> None:
    src = tmp_path / "small.tsv"
    src.write_text("\n".join(KAGGLE.read_text().splitlines()[:100]) + "\n")
    spec = DataSpec(format="criteo", path=str(src))
    first = open_dataset(spec)
    where = cache_path(spec)
    assert where.parent == tmp_path / "small.tsv.bagpipe" and first.num_rows == 100
    stamp = (where / "manifest.json").stat().st_mtime_ns
    assert open_dataset(spec).num_rows == 100
    assert (where / "manifest.json").stat().st_mtime_ns == stamp  # reused
    src.write_text("\n".join(KAGGLE.read_text().splitlines()[:60]) + "\n")
    assert open_dataset(spec).num_rows == 60  # source changed: converted again
    other = DataSpec(format="criteo", path=str(src), table_sizes=(1000,) * 26)
    assert cache_path(other) != where and open_dataset(other).table_sizes == (1000,) * 26


def test_dictionary_mode(tmp_path: Path) -> None:
    spec = DataSpec(format="criteo", path=str(KAGGLE), hashing="dictionary", cache_dir=str(tmp_path))
    data = open_dataset(spec)
    sparse = data.rows(0, 8000).sparse
    distinct = sum(len(np.unique(sparse[:, t])) for t in range(26))
    assert distinct == 37_100  # distinct (column, value) pairs, samples/README.md
    assert all(sparse[:, t].max() < n for t, n in enumerate(data.table_sizes))
    assert data.table_sizes[8] == 2 + 3  # C9: missing, rare, 3 values
    capped = open_dataset(DataSpec(format="criteo", path=str(KAGGLE), hashing="dictionary",
                                   min_frequency=5, table_sizes=(50,) * 26, cache_dir=str(tmp_path)))  # fmt: skip
    rows = capped.rows(0, 8000).sparse
    assert capped.table_sizes == (50,) * 26 and rows.max() < 50
    assert (rows == 1).any() and np.bincount(rows[:, 0])[2] == np.bincount(rows[:, 0])[2:].max()


def test_avazu_round_trip(tmp_path: Path) -> None:
    data = open_dataset(DataSpec(format="avazu", path=str(AVAZU), cache_dir=str(tmp_path)))
    b = next(data.train_batches(100))
    assert b.dense.shape == (100, 0) and b.sparse.shape == (100, 23)
    assert (b.sparse[:, 0] >= 1).all() and (b.sparse[:, 0] <= 24).all() and (b.sparse[:, 1] <= 7).all()


def test_two_openers_of_one_source_convert_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second opener, started while the first converts, waits for that conversion and
    opens it rather than converting again (or failing to rename its own into place)."""
    src = tmp_path / "small.tsv"
    src.write_text("\n".join(KAGGLE.read_text().splitlines()[:100]) + "\n")
    spec = DataSpec(format="criteo", path=str(src))
    converting, go = threading.Event(), threading.Event()
    conversions: list[str] = []
    missed = {"first": threading.Event(), "second": threading.Event()}
    run = Conversion.run

    def slow_run(self, *args, **kwargs):
        conversions.append(threading.current_thread().name)
        converting.set()
        go.wait()
        return run(self, *args, **kwargs)

    def recorded_open(path: Path):
        try:
            return open_preprocessed(path)
        except ConfigError:
            missed[threading.current_thread().name].set()
            raise

    monkeypatch.setattr(Conversion, "run", slow_run)
    monkeypatch.setattr(dataset, "open_preprocessed", recorded_open)
    opened: dict[str, int] = {}

    def open_it() -> None:
        opened[threading.current_thread().name] = open_dataset(spec).num_rows

    threads = [threading.Thread(name=name, target=open_it) for name in ("first", "second")]
    threads[0].start()
    assert converting.wait(timeout=60), "the first opener never started converting"
    threads[1].start()
    assert missed["second"].wait(timeout=60), "the second opener never looked"  # and found none either
    go.set()
    for t in threads:
        t.join(timeout=60)
    assert conversions == ["first"] and opened == {"first": 100, "second": 100}
