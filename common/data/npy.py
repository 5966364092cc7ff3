"""TorchRec's Criteo days (``day_N_{dense,sparse,labels}.npy``), memory-mapped and streamed.

The files as ``torchrec.datasets.criteo.BinaryCriteoUtils`` writes them:

* ``tsv_to_npys``: dense float32 [N, 13], *already transformed* (torchrec takes
  ``log(x - m + 2)`` with m the smallest dense value of the whole day, a missing value
  counting as 0; our raw readers take ``log(1 + max(x, 0))``): read as it is. Sparse int64
  [N, 26], the raw 8-hex-digit values as integers with 0 for a missing value. Labels int32
  [N, 1] (-1 throughout the unlabelled Kaggle test set, which is refused).
* ``sparse_to_contiguous``: ``day_N_sparse_contig_freq.npy``, int64 ids 1 (rare), 2, 3, ...
  (often renamed ``day_N_sparse.npy``, as ``shuffle`` expects); ``shuffle``: the same three
  names again, sparse int32. Contiguous ids are rows already: use ``hashing = "none"``.

A sparse value 0 is read as missing (torchrec writes an empty field as 0, so a literal
``00000000`` value is missing here too); with ``hashing = "none"`` it is row 0 either way.
Every day's headers, dtypes, shapes and row counts are checked before the first row is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.chunks import (
    Check, MalformedData, RawChunk, Reader, bytes_done, column_checks, id_values, label_values, row_errors,
)  # fmt: skip
from common.data.spec import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, DataSpec
from common.errors import ConfigError

CHUNK_ROWS = 1 << 18
PIECE_ROWS = 1 << 22  # rows of a day one conversion worker takes at a time (about 1 GB of arrays)
_DAY = re.compile(r"day_(\d+)_(?:dense|labels)\.npy")
# torchrec's names for a day's sparse file: tsv_to_npys and shuffle, sparse_to_contiguous.
SPARSE_NAMES = ("day_{n}_sparse.npy", "day_{n}_sparse_contig_freq.npy")


@dataclass(frozen=True, kw_only=True)
class Day:
    """One day's three files, memory-mapped and checked against each other."""

    files: dict[str, Path]  # "labels", "dense", "sparse" -> file
    labels: np.ndarray  # [N] or [N, 1]
    dense: np.ndarray  # [N, 13] floating
    sparse: np.ndarray  # [N, 26] integer

    @property
    def rows(self) -> int:
        return len(self.labels)

    def file_of(self, column: str) -> Path:
        return self.files["labels" if column == "label" else "dense" if column in CRITEO_DENSE_NAMES else "sparse"]


def day_files(path: Path, sparse_dir: Path) -> list[dict[str, Path]]:
    """The files of every day found in `path` (and `sparse_dir`), in day order.

    Raises ConfigError naming the field when a day lacks one of its files or has two
    candidate sparse files (point ``sparse_path`` at a folder holding one)."""
    if not path.is_dir():
        raise ConfigError("data.path", f"{path} is not a folder of torchrec day_N_*.npy files")
    days = sorted({int(m.group(1)) for p in path.iterdir() if (m := _DAY.fullmatch(p.name))})
    if not days:
        raise ConfigError("data.path", f"{path} holds no day_N_dense.npy or day_N_labels.npy file")
    return [_one_day(path, sparse_dir, n) for n in days]


def _one_day(path: Path, sparse_dir: Path, n: int) -> dict[str, Path]:
    files = {part: path / f"day_{n}_{part}.npy" for part in ("labels", "dense")}
    for file in files.values():
        if not file.is_file():
            raise ConfigError("data.path", f"{file} is missing: a day needs its dense, sparse and labels files")
    sparse = [sparse_dir / name.format(n=n) for name in SPARSE_NAMES if (sparse_dir / name.format(n=n)).is_file()]
    field = "data.sparse_path" if sparse_dir != path else "data.path"
    if len(sparse) != 1:
        found = ", ".join(p.name for p in sparse) or "none"
        raise ConfigError(field, f"day {n} needs one sparse file in {sparse_dir} "
                          f"({' or '.join(SPARSE_NAMES).format(n=n)}); found {found}")  # fmt: skip
    return {**files, "sparse": sparse[0]}


def _load(file: Path) -> np.ndarray:
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MalformedData(file, None, f"is not a readable .npy array ({exc})") from None


# part -> (dtype kinds accepted, columns, what torchrec writes there)
_LAYOUT: dict[str, tuple[str, int | None, str]] = {
    "labels": ("biuf", None, "int32 [N, 1] labels"),
    "dense": ("f", len(CRITEO_DENSE_NAMES), "float32 [N, 13] dense features"),
    "sparse": ("iu", len(CRITEO_SPARSE_NAMES), "integer [N, 26] categorical ids"),
}


def open_day(files: dict[str, Path]) -> Day:
    """Memory-map one day and check each file's dtype and shape, and that they agree."""
    arrays = {part: _load(file) for part, file in files.items()}
    for part, a in arrays.items():
        kinds, width, what = _LAYOUT[part]
        shape_ok = a.ndim == 2 and a.shape[1] == width if width else a.ndim == 1 or (a.ndim == 2 and a.shape[1] == 1)
        if a.dtype.kind not in kinds or not shape_ok:
            raise MalformedData(files[part], None, f"holds {a.dtype} {list(a.shape)}; torchrec writes {what}")
    rows = len(arrays["labels"])
    for part in ("dense", "sparse"):
        if len(arrays[part]) != rows:
            raise MalformedData(files[part], None, f"has {len(arrays[part])} rows, {files['labels'].name} has {rows}")
    return Day(files=files, **arrays)


def parse_rows(labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray,
               sizes: tuple[int, ...] | None) -> tuple[RawChunk, list[Check]]:  # fmt: skip
    """A chunk of a day's rows (memmap slices) and the rules its rows must follow."""
    raw_labels = np.asarray(labels).reshape(-1)
    label, label_check = label_values("label", raw_labels, None, raw_labels)
    d = np.asarray(dense, dtype=np.float32)
    s = np.asarray(sparse)
    ids, id_checks = id_values(CRITEO_SPARSE_NAMES, s.astype(np.int64, copy=False), s == 0, s.T, sizes)
    checks = [label_check, *column_checks(CRITEO_DENSE_NAMES, ~np.isfinite(d), d.T, "must be finite"), *id_checks]
    return RawChunk(labels=label, dense=d, ids=ids), checks


class NpyDaysReader(Reader):
    """Streams `RawChunk`s from a folder of torchrec Criteo days, day by day (a `Reader`;
    the module docstring says what is read and how). Opening maps and checks every day."""

    num_dense = len(CRITEO_DENSE_NAMES)
    tables = CRITEO_SPARSE_NAMES

    def __init__(self, spec: DataSpec, *, on_bytes: Callable[[int], None] = lambda n: None) -> None:
        if spec.format != "criteo-npy" or spec.path is None:
            raise ConfigError("data.format", f"{spec.format!r} is not criteo-npy")
        super().__init__(on_error=spec.on_error, on_bytes=on_bytes)
        path = Path(spec.path)
        found = day_files(path, Path(spec.sparse_path) if spec.sparse_path else path)
        self.days = [open_day(files) for files in found]
        self.files = [f for day in self.days for f in day.files.values()]
        self.sizes = spec.table_sizes if spec.hashing == "none" else None

    def chunks(self) -> Iterator[RawChunk]:
        for day in self.days:
            yield from day_chunks(self, day, 0, day.rows)


def day_chunks(reader: Reader, day: Day, first: int, last: int) -> Iterator[RawChunk]:
    """Rows ``[first, last)`` of `day`, checked (by `reader`'s rule for bad rows), in chunks;
    the reader's `on_bytes` is told of the day's bytes in proportion."""
    size = sum(f.stat().st_size for f in day.files.values())
    sizes = reader.sizes  # type: ignore[attr-defined]
    for start in range(first, last, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, last)
        cut = slice(start, stop)
        chunk, checks = parse_rows(day.labels[cut], day.dense[cut], day.sparse[cut], sizes)
        reader.on_bytes(bytes_done(size, stop, day.rows) - bytes_done(size, start, day.rows))
        yield reader.keep(chunk, checks, row_errors(start, day.file_of))


class NpyPiece(Reader):
    """Rows ``[start, stop)`` of one day (a `Reader`): what a conversion worker or a window
    of the in-place data set reads."""

    num_dense = len(CRITEO_DENSE_NAMES)
    tables = CRITEO_SPARSE_NAMES

    def __init__(self, spec: DataSpec, files: dict[str, Path], start: int, stop: int, *,
                 on_bytes: Callable[[int], None] = lambda n: None) -> None:  # fmt: skip
        super().__init__(on_error=spec.on_error, on_bytes=on_bytes)
        self.day, self.start, self.stop = open_day(files), start, stop
        self.files = list(files.values())
        self.sizes = spec.table_sizes if spec.hashing == "none" else None

    def chunks(self) -> Iterator[RawChunk]:
        yield from day_chunks(self, self.day, self.start, self.stop)


def day_rows(files: dict[str, Path]) -> int:
    """A day's rows, from its labels file's header (the file is not read)."""
    return int(_load(files["labels"]).shape[0])

