"""Conversion in pieces and workers: the same bytes as one process reading in order, the
first bad line reported whoever finds it, and a stopped conversion resumed, not redone."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.data.chunks import MalformedData
from common.data.dataset import ConvertingDataset, cache_path, open_dataset
from common.data.preprocessed import open_preprocessed
from common.data.spec import DataSpec
from tests.common.data.conftest import AVAZU, KAGGLE, TERABYTE
from tests.common.data.sources import assert_incomplete

conversion = importlib.import_module("common.data.convert")  # the package exports a function of that name
REPO = Path(__file__).resolve().parents[3]

# blake2b (8 bytes) of labels, dense and sparse of each case as the single-process converter
# wrote them before conversion went parallel (the commit before 5e08c10), and its table sizes;
# the dense values as `dense_transform` rounds them on every CPU since (numpy's float32 log1p
# before gave other last bits on AVX-512 machines than elsewhere).
PINNED = {
    "kaggle-hash": ("a8701d1ac2a4caef", dict(format="criteo", path=str(KAGGLE))),
    "kaggle-dict": ("42b99ff0b53d895c", dict(format="criteo", path=str(KAGGLE), hashing="dictionary")),
    "kaggle-dict-capped": ("4209c614730c2ec2", dict(format="criteo", path=str(KAGGLE), hashing="dictionary",
                                                    min_frequency=3, table_sizes=(50,) * 26)),
    "terabyte-hash": ("b2d4b3d3d6a3cae0", dict(format="criteo-terabyte", path=str(TERABYTE))),
    "avazu-hash": ("531e84ee1e79c912", dict(format="avazu", path=str(AVAZU))),
    "avazu-dict": ("9b5b3f4b2ce6ac19", dict(format="avazu", path=str(AVAZU), hashing="dictionary")),
}  # fmt: skip
KAGGLE_DICT_SIZES = (159, 372, 4526)  # the first three tables, as then


def digest(out: Path) -> str:
    data = open_preprocessed(out)
    parts = [data.arrays(k) for k in range(len(data.manifest.parts))]
    h = hashlib.blake2b(digest_size=8)
    for i in range(3):
        h.update(np.ascontiguousarray(np.concatenate([p[i] for p in parts])).tobytes())
    return h.hexdigest()


def tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of about 100 kB: the 1.9 MB Kaggle sample in 20 pieces, the others in a few."""
    monkeypatch.setattr(conversion, "PIECE_BYTES", 100_000)


@pytest.mark.parametrize("case", PINNED)
def test_pieces_join_into_the_bytes_one_process_wrote(tmp_path: Path, small_pieces: None, case: str) -> None:
    want, fields = PINNED[case]
    manifest = conversion.convert(DataSpec(**fields), tmp_path / "out", progress=False, workers=1)
    assert digest(tmp_path / "out") == want
    assert len(manifest.parts) > (10 if case.startswith("kaggle") else 0)
    if case == "kaggle-dict":
        assert manifest.table_sizes[:3] == KAGGLE_DICT_SIZES


def test_a_gzipped_file_converts_to_the_same_bytes(tmp_path: Path) -> None:
    gz = tmp_path / "k.tsv.gz"
    with gzip.open(gz, "wb") as f:
        f.write(KAGGLE.read_bytes())
    conversion.convert(DataSpec(format="criteo", path=str(gz)), tmp_path / "out", progress=False)
    assert digest(tmp_path / "out") == PINNED["kaggle-hash"][0]


@pytest.mark.slow  # starting workers takes seconds
@pytest.mark.parametrize("hashing", ["hash", "dictionary"])
def test_two_workers_write_what_one_writes(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch, hashing: str
) -> None:
    """Byte for byte, every file: the plan, the parts, the dictionaries, the manifest."""
    monkeypatch.setattr(conversion, "PARALLEL_BYTES", 0)  # processes even for this little
    spec = DataSpec(format="criteo", path=str(KAGGLE), hashing=hashing)
    conversion.convert(spec, tmp_path / "one", progress=False, workers=1)
    conversion.convert(spec, tmp_path / "two", progress=False, workers=2)
    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    assert one.keys() == two.keys() and all(one[k] == two[k] for k in one)
    assert digest(tmp_path / "two") == PINNED[f"kaggle-{hashing[:4]}"][0]


def bad_copy(tmp_path: Path, bad: dict[int, str]) -> Path:
    lines = KAGGLE.read_text().splitlines()
    for number, text in bad.items():
        lines[number - 1] = text
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_the_first_bad_line_is_reported_whichever_worker_finds_it(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Line 6,500 (a late piece) is bad, and line 2,345 (an early one) worse."""
    monkeypatch.setattr(conversion, "PARALLEL_BYTES", 0)
    path = bad_copy(tmp_path, {2345: "1\t2", 6500: "7" + KAGGLE.read_text().splitlines()[6499][1:]})
    with pytest.raises(MalformedData) as info:
        conversion.convert(DataSpec(format="criteo", path=str(path)), tmp_path / "out", progress=False, workers=2)
    assert str(info.value) == f"{path}:2345: expected 40 fields, got 2: '1\\t2'"
    assert_incomplete(tmp_path / "out")


def test_bad_lines_of_later_pieces_are_numbered_in_their_file(tmp_path: Path, small_pieces: None) -> None:
    path = bad_copy(tmp_path, {7001: "2" + KAGGLE.read_text().splitlines()[7000][1:]})
    with pytest.raises(MalformedData, match=r"bad\.tsv:7001: bad label value '2'"):
        conversion.convert(DataSpec(format="criteo", path=str(path)), tmp_path / "out", progress=False)
    kept = list((tmp_path / "out" / "parts").glob("*/*/part.json"))
    assert len(kept) > 10  # the pieces before it, kept for the next run


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt, which pytest takes for the user stopping the tests."""


def test_a_stopped_conversion_resumes_where_it_stopped(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = DataSpec(format="criteo", path=str(KAGGLE))
    out = tmp_path / "out"
    work, calls, stop_at = conversion.work, [], [6]

    def interrupted(kind, task, *args):
        calls.append(task.index)
        if stop_at and len(calls) == stop_at[0]:
            stop_at.clear()
            raise Interrupted  # as Ctrl-C would, in the middle of the sixth piece
        return work(kind, task, *args)

    monkeypatch.setattr(conversion, "work", interrupted)
    with pytest.raises(Interrupted):
        conversion.convert(spec, out, progress=False, workers=1)
    assert_incomplete(out)
    done = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("parts/*/*/part.json")}
    assert sorted(done) == [f"{i:05d}" for i in range(5)] and not list(out.glob("parts/*/.*"))
    calls.clear()
    conversion.convert(spec, out, progress=False, workers=1)
    assert calls == list(range(5, len(calls) + 5))  # the rest, and only the rest
    again = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("parts/*/*/part.json")}
    assert {name: stamp for name, stamp in again.items() if name in done} == done
    assert digest(out) == PINNED["kaggle-hash"][0]


def test_a_damaged_part_is_done_again_and_only_it(tmp_path: Path, small_pieces: None) -> None:
    spec = DataSpec(format="criteo", path=str(KAGGLE), cache_dir=str(tmp_path))
    open_dataset(spec)
    out = cache_path(spec)
    parts = sorted(out.glob("parts/*/*"))
    (parts[3] / "sparse.i32").write_bytes((parts[3] / "sparse.i32").read_bytes()[:-4])
    stamps = {p: (p / "part.json").stat().st_mtime_ns for p in parts}
    assert open_dataset(spec).num_rows == 8000  # the cache is unusable: converted again, in part
    changed = [p for p in parts if (p / "part.json").stat().st_mtime_ns != stamps[p]]
    assert changed == [parts[3]] and digest(out) == PINNED["kaggle-hash"][0]


def test_a_changed_file_is_done_again_and_only_it(tmp_path: Path) -> None:
    lines = KAGGLE.read_text().splitlines()
    for day, (a, b) in enumerate([(0, 3000), (3000, 5000), (5000, 8000)]):
        (tmp_path / f"day_{day}.tsv").write_text("\n".join(lines[a:b]) + "\n")
    spec = DataSpec(format="criteo", path=str(tmp_path / "day_*.tsv"))
    assert open_dataset(spec).num_rows == 8000
    out = cache_path(spec)
    assert out.parent == tmp_path / ".bagpipe"
    stamps = {p.parent.parent.name: p.stat().st_mtime_ns for p in out.glob("parts/*/*/part.json")}
    (tmp_path / "day_1.tsv").write_text("\n".join(lines[3000:4000]) + "\n")
    assert open_dataset(spec).num_rows == 7000
    now = {p.parent.parent.name: p.stat().st_mtime_ns for p in out.glob("parts/*/*/part.json")}
    assert [k for k in stamps if now[k] != stamps[k]] == [k for k in stamps if k.startswith("day_1.")]


def test_files_lists_and_patterns_are_read_in_order(tmp_path: Path) -> None:
    lines = KAGGLE.read_text().splitlines()
    for day, (a, b) in [(2, (0, 100)), (10, (100, 300)), (1, (300, 350))]:
        with gzip.open(tmp_path / f"day_{day}.gz", "wt") as f:
            f.write("\n".join(lines[a:b]) + "\n")
    whole = open_dataset(DataSpec(format="criteo", path=str(KAGGLE))).rows(0, 350)
    by_pattern = open_dataset(DataSpec(format="criteo", path=str(tmp_path / "day_*.gz"))).rows(0, 350)
    order = [1, 2, 10]  # natural order: day_1 (rows 300..350), day_2, day_10
    want = np.concatenate([whole.sparse[300:350], whole.sparse[:100], whole.sparse[100:300]])
    np.testing.assert_array_equal(by_pattern.sparse, want)
    listed = DataSpec(format="criteo", path=tuple(str(tmp_path / f"day_{d}.gz") for d in (2, 10, 1)))
    np.testing.assert_array_equal(open_dataset(listed).rows(0, 350).sparse, whole.sparse[:350])  # as written
    assert order == [1, 2, 10]
    assert cache_path(listed) != cache_path(DataSpec(format="criteo", path=str(tmp_path / "day_*.gz")))


def test_training_starts_before_the_conversion_ends(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first file is converted while the lines of the others are counted: the data set
    opens with its exact length, and a read of rows not converted yet waits for them."""
    lines = KAGGLE.read_text().splitlines()
    for day, (a, b) in enumerate([(0, 2000), (2000, 8000)]):
        (tmp_path / f"day_{day}.tsv").write_text("\n".join(lines[a:b]) + "\n")
    spec = DataSpec(format="criteo", path=str(tmp_path / "day_*.tsv"), eval_fraction=0.1)
    work, released = conversion.work, __import__("threading").Event()

    def held(kind, task, *args):
        if kind == "convert" and task.unit.name == "day_1.tsv":
            assert released.wait(60)
        return work(kind, task, *args)

    monkeypatch.setattr(conversion, "work", held)
    data = open_dataset(spec, background=True)
    assert isinstance(data, ConvertingDataset) and data.num_rows == 8000 and data.num_train_rows == 7200
    assert not data.conversion.done
    first = data.rows(0, 2000)  # the first file: there already
    released.set()
    rest = data.rows(2000, 8000)  # waits for the second
    data.conversion.join()
    whole = open_dataset(DataSpec(format="criteo", path=str(KAGGLE))).rows(0, 8000)
    np.testing.assert_array_equal(np.concatenate([first.sparse, rest.sparse]), whole.sparse)
    np.testing.assert_array_equal(np.concatenate([first.dense, rest.dense]), whole.dense)
    assert open_dataset(spec).rows(0, 8000).labels.tolist() == whole.labels.tolist()  # complete now


_KILLED = """
import importlib, sys
from pathlib import Path
from common.data.spec import DataSpec
conversion = importlib.import_module("common.data.convert")
conversion.PIECE_BYTES = 10_000_000
conversion.convert(DataSpec(format="criteo", path=sys.argv[1]), Path(sys.argv[2]), progress=False, workers=1)
"""


@pytest.mark.slow
def test_a_killed_conversion_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL, whatever it was doing: what it finished is kept, nothing else looks finished."""
    big = tmp_path / "big.tsv"
    with big.open("wb") as f:
        for _ in range(60):  # 480 k rows, 116 MB: 12 pieces
            f.write(KAGGLE.read_bytes())
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(big), str(out)], cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while not list(out.glob("parts/*/*/part.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert_incomplete(out)
    kept = {p: p.stat().st_mtime_ns for p in out.glob("parts/*/*/part.json")}
    assert kept, "killed before any part was written"
    monkeypatch.setattr(conversion, "PIECE_BYTES", 10_000_000)
    manifest = conversion.convert(DataSpec(format="criteo", path=str(big)), out, progress=False, workers=1)
    assert manifest.rows == 480_000 and all(p.stat().st_mtime_ns == t for p, t in kept.items())
    data = open_preprocessed(out)
    np.testing.assert_array_equal(data.arrays(len(manifest.parts) - 1)[1][-8000:],
                                  open_preprocessed_sample_dense(tmp_path))  # fmt: skip


def open_preprocessed_sample_dense(tmp_path: Path) -> np.ndarray:
    conversion.convert(DataSpec(format="criteo", path=str(KAGGLE)), tmp_path / "sample", progress=False)
    return open_preprocessed(tmp_path / "sample").arrays(0)[1]
