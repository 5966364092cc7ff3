"""The preprocessed format: a directory of flat little-endian arrays plus a manifest.

Layout (N rows, D dense features, F tables)::

    manifest.json   version, rows, num_dense, table_sizes, sparse_dtype, config, source, files
    labels.f32      float32 [N]
    dense.f32       float32 [N, D]
    sparse.i32      int32 [N, F] per-table row ids (sparse.i64 if a table has >= 2**31 rows)
    vocab_<t>.npy   dictionary of table t (dictionary hashing only)

Readers memory-map the arrays, so any batch is a slice. A directory is written under a
temporary name beside its final path and renamed into place only when complete, so an
interrupted conversion leaves nothing that looks finished and simply runs again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ConfigError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LABELS, DENSE = "labels.f32", "dense.f32"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a preprocessed directory holds and how it was made."""

    rows: int
    num_dense: int
    table_sizes: tuple[int, ...]
    config: dict[str, Any]  # the settings that determine the arrays' content
    source: dict[str, Any]  # raw files (name, bytes, mtime_ns), blake2b, skipped lines
    extra_files: tuple[str, ...] = ()

    @property
    def sparse_dtype(self) -> np.dtype:
        return np.dtype(np.int64 if max(self.table_sizes, default=1) > 2**31 - 1 else np.int32)

    @property
    def sparse_file(self) -> str:
        return "sparse.i64" if self.sparse_dtype == np.int64 else "sparse.i32"

    def shapes(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {
            LABELS: (np.dtype(np.float32), (self.rows,)),
            DENSE: (np.dtype(np.float32), (self.rows, self.num_dense)),
            self.sparse_file: (self.sparse_dtype, (self.rows, len(self.table_sizes))),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION, "rows": self.rows, "num_dense": self.num_dense,
            "table_sizes": list(self.table_sizes), "sparse_dtype": self.sparse_dtype.name,
            "config": self.config, "source": self.source, "extra_files": list(self.extra_files),
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> Manifest:
        if data.get("version") != FORMAT_VERSION:
            raise ConfigError("data.path", f"{where}: manifest version {data.get('version')!r}, "
                              f"this code reads {FORMAT_VERSION}")  # fmt: skip
        try:
            return cls(
                rows=int(data["rows"]), num_dense=int(data["num_dense"]),
                table_sizes=tuple(int(n) for n in data["table_sizes"]), config=dict(data["config"]),
                source=dict(data["source"]), extra_files=tuple(data.get("extra_files", ())),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("data.path", f"{where}: manifest is incomplete ({exc!r})") from None


@dataclass(frozen=True, kw_only=True)
class Preprocessed:
    """An opened directory: read-only memmaps (plain empty arrays when N is 0)."""

    path: Path
    manifest: Manifest
    labels: np.ndarray = field(repr=False)
    dense: np.ndarray = field(repr=False)
    sparse: np.ndarray = field(repr=False)


def open_preprocessed(path: Path) -> Preprocessed:
    """Open and check a preprocessed directory.

    Raises ConfigError("data.path", ...) when the manifest is missing or unreadable, or an
    array file is missing or does not have the size the manifest promises (truncated).
    """
    manifest = read_manifest(path)
    arrays = []
    for name, (dtype, shape) in manifest.shapes().items():
        file = path / name
        want = int(np.prod(shape)) * dtype.itemsize
        if not file.is_file():
            raise ConfigError("data.path", f"{path}: {name} is missing; convert the data again")
        have = file.stat().st_size
        if have != want:
            raise ConfigError("data.path", f"{path}: {name} has {have} bytes, the manifest "
                              f"promises {want} (truncated or foreign); convert the data again")  # fmt: skip
        arrays.append(np.memmap(file, dtype=dtype, mode="r", shape=shape) if want else np.empty(shape, dtype))
    for name in manifest.extra_files:
        if not (path / name).is_file():
            raise ConfigError("data.path", f"{path}: {name} is missing; convert the data again")
    labels, dense, sparse = arrays
    return Preprocessed(path=path, manifest=manifest, labels=labels, dense=dense, sparse=sparse)


def read_manifest(path: Path) -> Manifest:
    file = path / MANIFEST
    if not file.is_file():
        raise ConfigError("data.path", f"{path} is not a preprocessed data directory (no {MANIFEST})")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("data.path", f"{file} is unreadable: {exc}") from None
    return Manifest.from_json(data, path)


class Writer:
    """Appends rows to a new directory under a temporary name; `commit` renames it into place.

    Use as a context manager: leaving the block without `commit` (an exception, Ctrl-C)
    deletes the temporary directory.
    """

    def __init__(self, final: Path, *, num_dense: int, table_sizes: tuple[int, ...]) -> None:
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(final)
        self.tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        probe = Manifest(rows=0, num_dense=num_dense, table_sizes=table_sizes, config={}, source={})
        self._dtype = probe.sparse_dtype
        self._files = {name: (self.tmp / name).open("wb") for name in probe.shapes()}
        self._names = list(probe.shapes())
        self.num_dense, self.table_sizes = num_dense, table_sizes
        self.rows = 0

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def append(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        """Rows must be in range for their table (checked: a bad mapping must not land on disk)."""
        if sparse.size and (sparse.min() < 0 or (sparse >= np.asarray(self.table_sizes)).any()):
            raise ValueError("row id outside its table")
        parts = (labels.astype(np.float32), dense.astype(np.float32), sparse.astype(self._dtype))
        for name, part in zip(self._names, parts, strict=True):
            self._files[name].write(np.ascontiguousarray(part).tobytes())
        self.rows += len(labels)

    def commit(self, *, config: dict[str, Any], source: dict[str, Any], extra_files: Iterable[str] = ()) -> Manifest:
        """Finish the files, write the manifest last, and move the directory into place."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        manifest = Manifest(
            rows=self.rows, num_dense=self.num_dense, table_sizes=self.table_sizes,
            config=config, source=source, extra_files=tuple(extra_files),
        )  # fmt: skip
        (self.tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
            shutil.rmtree(old)
        os.replace(self.tmp, self.final)
        log.info("wrote %d rows to %s", self.rows, self.final)
        return manifest


def _remove_stale_temps(final: Path) -> None:
    """Delete temporaries left by conversions whose process is gone (interrupted runs)."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s left by an interrupted conversion", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
