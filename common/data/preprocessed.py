"""The preprocessed format: a directory of flat little-endian arrays in parts, plus a manifest.

Layout (N rows, D dense features, F tables)::

    manifest.json     version, rows, num_dense, table_sizes, sparse_dtype, config, source,
                      extra files, parts (each a folder and its rows, in row order)
    <part>/labels.f32 float32 [n]        (a part's n rows; the parts' rows add up to N)
    <part>/dense.f32  float32 [n, D]
    <part>/sparse.i32 int32 [n, F] per-table row ids (sparse.i64 if a table has >= 2**31 rows)
    vocab_<t>.npy     dictionary of table t (dictionary hashing only)

A conversion writes one part per piece of its source (``parts/<file>/<piece>/``, with a
``part.json`` saying what it holds); `write_synthetic` and version 1 directories have one
part, ``.``, the arrays at the top. Readers memory-map a part's arrays when first read, so
any batch is a slice (or two, across parts).

Nothing that looks finished is ever half-written: a part is written under a temporary name
and renamed into place when complete, and the manifest, which is what makes a directory
complete, is written last.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ConfigError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
PART = "part.json"
FORMAT_VERSION = 2  # 2: parts; 1 (still read): one set of arrays at the top
LABELS, DENSE = "labels.f32", "dense.f32"
OPEN_PARTS = 8  # parts whose memmaps a reader keeps open (each holds three file descriptors)


@dataclass(frozen=True, kw_only=True)
class Part:
    """One folder of arrays: `name` relative to the directory ("." for the top), `rows` rows."""

    name: str
    rows: int


def sparse_dtype(table_sizes: tuple[int, ...]) -> np.dtype:
    return np.dtype(np.int64 if max(table_sizes, default=1) > 2**31 - 1 else np.int32)


def array_shapes(
    rows: int, num_dense: int, table_sizes: tuple[int, ...]
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """File name → (dtype, shape) of the arrays of a part of `rows` rows."""
    dtype = sparse_dtype(table_sizes)
    return {
        LABELS: (np.dtype(np.float32), (rows,)),
        DENSE: (np.dtype(np.float32), (rows, num_dense)),
        "sparse.i64" if dtype == np.int64 else "sparse.i32": (dtype, (rows, len(table_sizes))),
    }


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a preprocessed directory holds and how it was made."""

    rows: int
    num_dense: int
    table_sizes: tuple[int, ...]
    config: dict[str, Any]  # the settings that determine the arrays' content
    source: dict[str, Any]  # source files (name, bytes, mtime_ns), sampled checksum, skipped lines
    extra_files: tuple[str, ...] = ()
    parts: tuple[Part, ...] = ()  # () only for an empty directory

    @property
    def sparse_dtype(self) -> np.dtype:
        return sparse_dtype(self.table_sizes)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION, "rows": self.rows, "num_dense": self.num_dense,
            "table_sizes": list(self.table_sizes), "sparse_dtype": self.sparse_dtype.name,
            "config": self.config, "source": self.source, "extra_files": list(self.extra_files),
            "parts": [{"name": p.name, "rows": p.rows} for p in self.parts],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> Manifest:
        version = data.get("version")
        if version not in (1, FORMAT_VERSION):
            raise ConfigError("data.path", f"{where}: manifest version {version!r}, "
                              f"this code reads 1 and {FORMAT_VERSION}")  # fmt: skip
        try:
            rows = int(data["rows"])
            parts = [Part(name=".", rows=rows)] if version == 1 else [Part(name=str(p["name"]), rows=int(p["rows"]))
                                                                      for p in data["parts"]]  # fmt: skip
            manifest = cls(
                rows=rows, num_dense=int(data["num_dense"]),
                table_sizes=tuple(int(n) for n in data["table_sizes"]), config=dict(data["config"]),
                source=dict(data["source"]), extra_files=tuple(data.get("extra_files", ())), parts=tuple(parts),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("data.path", f"{where}: manifest is incomplete ({exc!r})") from None
        if sum(p.rows for p in manifest.parts) != rows:
            raise ConfigError("data.path", f"{where}: the manifest's parts do not add up to its {rows} rows")
        return manifest


class Preprocessed:
    """An opened directory: its manifest, and the arrays of each part as read-only memmaps
    (plain empty arrays for an empty part), mapped when first read. Not thread-safe: one
    reader per thread."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path, self.manifest = path, manifest
        self._open: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    def arrays(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels, dense, sparse) of part k."""
        if k not in self._open:
            if len(self._open) >= OPEN_PARTS:
                self._open.popitem(last=False)
            m = self.manifest
            self._open[k] = map_part(self.path / m.parts[k].name, m.parts[k].rows, m.num_dense, m.table_sizes)
        self._open.move_to_end(k)
        labels, dense, sparse = self._open[k]
        return labels, dense, sparse


def map_part(folder: Path, rows: int, num_dense: int, table_sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The arrays of a part, memory-mapped read-only (an empty one, which cannot be mapped, in memory)."""
    shapes = array_shapes(rows, num_dense, table_sizes).items()
    return tuple(np.memmap(folder / name, dtype=dtype, mode="r", shape=shape) if np.prod(shape)
                 else np.empty(shape, dtype) for name, (dtype, shape) in shapes)  # fmt: skip


def check_part(folder: Path, rows: int, num_dense: int, table_sizes: tuple[int, ...], where: Path) -> str | None:
    """Why the arrays in `folder` are not a part of `rows` rows (missing, or not the size
    promised: truncated or foreign), or None when they are."""
    for name, (dtype, shape) in array_shapes(rows, num_dense, table_sizes).items():
        file = folder / name
        shown = file.relative_to(where)
        want = int(np.prod(shape)) * dtype.itemsize
        if not file.is_file():
            return f"{shown} is missing"
        if (have := file.stat().st_size) != want:
            return f"{shown} has {have} bytes, the manifest promises {want} (truncated or foreign)"
    return None


def open_preprocessed(path: Path) -> Preprocessed:
    """Open and check a preprocessed directory.

    Raises ConfigError("data.path", ...) when the manifest is missing or unreadable, or an
    array file is missing or does not have the size the manifest promises (truncated).
    """
    manifest = read_manifest(path)
    for part in manifest.parts:
        if why := check_part(path / part.name, part.rows, manifest.num_dense, manifest.table_sizes, path):
            raise ConfigError("data.path", f"{path}: {why}; convert the data again")
    for name in manifest.extra_files:
        if not (path / name).is_file():
            raise ConfigError("data.path", f"{path}: {name} is missing; convert the data again")
    return Preprocessed(path, manifest)


def read_manifest(path: Path) -> Manifest:
    file = path / MANIFEST
    if not file.is_file():
        raise ConfigError("data.path", f"{path} is not a preprocessed data directory (no {MANIFEST})")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("data.path", f"{file} is unreadable: {exc}") from None
    return Manifest.from_json(data, path)


def write_json_atomically(path: Path, body: object) -> None:
    """Write `path` whole or not at all (a temporary file, fsynced, renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ArrayWriter:
    """Appends rows to the arrays of one part in `folder` (which must exist)."""

    def __init__(self, folder: Path, *, num_dense: int, table_sizes: tuple[int, ...]) -> None:
        self._dtype = sparse_dtype(table_sizes)
        self._files = [(folder / name).open("wb") for name in array_shapes(0, num_dense, table_sizes)]
        self._sizes = np.asarray(table_sizes, dtype=np.int64)
        self.rows = 0

    def append(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        """Rows must be in range for their table (checked: a bad mapping must not land on disk)."""
        if sparse.size and (sparse.min() < 0 or (sparse >= self._sizes).any()):
            raise ValueError("row id outside its table")
        parts = (np.asarray(labels, np.float32), np.asarray(dense, np.float32), np.asarray(sparse, self._dtype))
        for f, part in zip(self._files, parts, strict=True):
            if part.size:
                f.write(np.ascontiguousarray(part).data)
        self.rows += len(labels)

    def close(self, *, sync: bool) -> None:
        for f in self._files:
            if sync and not f.closed:
                f.flush()
                os.fsync(f.fileno())
            f.close()


@dataclass(kw_only=True)
class PartWriter:
    """Writes one part under a temporary name beside `final`; `commit` renames it into place
    with its ``part.json`` (`info`). Leaving the block without `commit` deletes it."""

    final: Path
    num_dense: int
    table_sizes: tuple[int, ...]
    tmp: Path = field(init=False)
    arrays: ArrayWriter = field(init=False)

    def __post_init__(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.arrays = ArrayWriter(self.tmp, num_dense=self.num_dense, table_sizes=self.table_sizes)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.arrays.close(sync=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, info: dict[str, Any]) -> None:
        self.arrays.close(sync=True)
        write_json_atomically(self.tmp / PART, {"rows": self.arrays.rows, **info})
        shutil.rmtree(self.final, ignore_errors=True)  # a part left by an older plan
        os.replace(self.tmp, self.final)


def read_part_info(folder: Path) -> dict[str, Any] | None:
    """A complete part's ``part.json``, or None (not there, or unreadable)."""
    try:
        return dict(json.loads((folder / PART).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Writer:
    """Appends rows to a new one-part directory under a temporary name; `commit` renames it
    into place. Use as a context manager: leaving the block without `commit` (an exception,
    Ctrl-C) deletes the temporary directory."""

    def __init__(self, final: Path, *, num_dense: int, table_sizes: tuple[int, ...]) -> None:
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(final)
        self.tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self._arrays = ArrayWriter(self.tmp, num_dense=num_dense, table_sizes=table_sizes)
        self.num_dense, self.table_sizes = num_dense, table_sizes

    @property
    def rows(self) -> int:
        return self._arrays.rows

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._arrays.close(sync=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def append(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        self._arrays.append(labels, dense, sparse)

    def commit(self, *, config: dict[str, Any], source: dict[str, Any], extra_files: Iterable[str] = ()) -> Manifest:
        """Finish the files, write the manifest last, and move the directory into place."""
        self._arrays.close(sync=True)
        manifest = Manifest(
            rows=self.rows, num_dense=self.num_dense, table_sizes=self.table_sizes, config=config, source=source,
            extra_files=tuple(extra_files), parts=(Part(name=".", rows=self.rows),),
        )  # fmt: skip
        (self.tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
            shutil.rmtree(old)
        os.replace(self.tmp, self.final)
        log.info("wrote %d rows to %s", self.rows, self.final)
        return manifest


def remove_stale_temps(final: Path) -> None:
    """Delete temporaries beside `final` left by writers whose process is gone (interrupted runs)."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not alive(int(pid)):
            log.info("removing %s left by an interrupted conversion", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
