"""Datasets: fixed-order batches for training, the held-out tail for evaluation.

`open_dataset(spec)` gives the same interface for every format:

* source formats (raw criteo, criteo-terabyte, avazu; TorchRec's criteo-npy days; parquet)
  are converted once into the preprocessed format, cached in
  ``<path>.bagpipe/<format>-<hashing>-<config hash>/`` (or under `cache_dir` when the spec
  sets it; under ``~/.cache/bagpipe/data/`` when the source's folder is read-only). The
  cache is reused while the conversion settings and the source files' sizes and mtimes
  match, and rebuilt otherwise; processes that open one source together convert it once
  (a file lock beside the cache). npy days and parquet go through the same conversion as raw
  logs, although both could be read in place: one checked pass at start-up finds a bad row
  before training rather than at iteration 10^6, the same code maps ids to rows (hash,
  dictionary, or as they are) for every format, and every role reads one layout (int32
  rows, float32 labels) instead of converting each batch.
* "preprocessed" opens a directory made by ``python -m common.data convert|synth``; a
  manifest that does not match the spec, or truncated arrays, are refused (ConfigError).
* "synthetic" generates rows on the fly from the seed.

Order: rows in file order (no shuffle), the same every epoch. The last `eval_fraction` of
rows is held out for `eval_batches`; training uses the rest, in batches that never cross an
epoch end (the last partial batch of each epoch is dropped).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.convert import conversion_config, convert, source_fingerprint
from common.data.preprocessed import Preprocessed, open_preprocessed
from common.data.spec import DataSpec
from common.data.synthetic import CHUNK_ROWS, Rows, SyntheticGenerator
from common.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """One batch. labels float32 [B]; dense float32 [B, num_dense]; sparse int64 [B, F] with
    ``0 <= sparse[:, t] < table_sizes[t]``. Arrays may be read-only views: copy to modify."""

    index: int
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray


class Dataset:
    """Rows ``[0, num_train_rows)`` train, ``[num_train_rows, num_rows)`` evaluate."""

    def __init__(self, *, num_rows: int, num_dense: int, table_sizes: tuple[int, ...], eval_fraction: float) -> None:
        self.num_rows = num_rows
        self.num_dense = num_dense
        self.table_sizes = table_sizes
        self.num_eval_rows = int(num_rows * eval_fraction)
        self.num_train_rows = num_rows - self.num_eval_rows

    def rows(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)`` of the whole data set (train and eval parts)."""
        raise NotImplementedError

    def num_batches(self, batch_size: int, epochs: int = 1) -> int:
        """Training iterations in `epochs` epochs (partial batches dropped)."""
        _check_batch(batch_size, epochs)
        return (self.num_train_rows // batch_size) * epochs

    def train_batches(self, batch_size: int, *, epochs: int = 1, start: int = 0) -> Iterator[Batch]:
        """Batches `start` .. num_batches - 1; batch g holds rows ``[b*B, (b+1)*B)`` of epoch
        ``g // per_epoch`` with ``b = g % per_epoch``. Starting late costs nothing."""
        total = self.num_batches(batch_size, epochs)
        per_epoch = self.num_train_rows // batch_size
        for g in range(max(start, 0), total):
            b = g % per_epoch
            yield self._batch(g, b * batch_size, (b + 1) * batch_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """The held-out rows in order, the last batch possibly shorter (every row evaluated)."""
        _check_batch(batch_size, 1)
        for i, first in enumerate(range(self.num_train_rows, self.num_rows, batch_size)):
            yield self._batch(i, first, min(first + batch_size, self.num_rows))

    def _batch(self, index: int, start: int, stop: int) -> Batch:
        r = self.rows(start, stop)
        return Batch(index=index, labels=r.labels, dense=r.dense, sparse=r.sparse)


def _check_batch(batch_size: int, epochs: int) -> None:
    if type(batch_size) is not int or batch_size < 1:
        raise ConfigError("train.batch_size", f"must be a positive integer, got {batch_size!r}")
    if type(epochs) is not int or epochs < 0:
        raise ConfigError("train.epochs", f"must be an integer >= 0, got {epochs!r}")


class ArrayDataset(Dataset):
    """A preprocessed directory read through memmaps; batches are slices."""

    def __init__(self, data: Preprocessed, eval_fraction: float) -> None:
        m = data.manifest
        super().__init__(num_rows=m.rows, num_dense=m.num_dense, table_sizes=m.table_sizes,
                         eval_fraction=eval_fraction)  # fmt: skip
        self.data = data

    def rows(self, start: int, stop: int) -> Rows:
        sparse = self.data.sparse[start:stop]
        return Rows(labels=np.asarray(self.data.labels[start:stop]), dense=np.asarray(self.data.dense[start:stop]),
                    sparse=np.asarray(sparse, dtype=np.int64))  # fmt: skip


class SyntheticDataset(Dataset):
    """Rows generated on demand; keeps the last two chunks so consecutive batches are cheap."""

    def __init__(self, spec: DataSpec) -> None:
        super().__init__(num_rows=spec.rows, num_dense=spec.num_dense, table_sizes=spec.table_sizes,
                         eval_fraction=spec.eval_fraction)  # fmt: skip
        self.generator = SyntheticGenerator(spec)
        self._recent: dict[int, Rows] = {}

    def rows(self, start: int, stop: int) -> Rows:
        stop = min(stop, self.num_rows)
        chunks = [self._chunk(i) for i in range(start // CHUNK_ROWS, -(-stop // CHUNK_ROWS))]
        first = (start // CHUNK_ROWS) * CHUNK_ROWS
        cut = slice(start - first, stop - first)
        if len(chunks) == 1:
            c = chunks[0]
            return Rows(labels=c.labels[cut], dense=c.dense[cut], sparse=c.sparse[cut])
        return Rows(**{k: np.concatenate([getattr(c, k) for c in chunks])[cut] for k in ("labels", "dense", "sparse")})

    def _chunk(self, i: int) -> Rows:
        if i not in self._recent:
            if len(self._recent) >= 2:
                self._recent.pop(min(self._recent))
            self._recent[i] = self.generator.chunk(i)
        return self._recent[i]


def open_dataset(spec: DataSpec, *, progress: bool = False) -> Dataset:
    """The data set a spec describes; converts a raw source into its cache on first use."""
    if spec.format == "synthetic":
        return SyntheticDataset(spec)
    if spec.format == "preprocessed":
        data = open_preprocessed(Path(str(spec.path)))
        if spec.table_sizes and spec.table_sizes != data.manifest.table_sizes:
            raise ConfigError("data.table_sizes", f"{spec.table_sizes} does not match "
                              f"{data.manifest.table_sizes} in {spec.path}")  # fmt: skip
        return ArrayDataset(data, spec.eval_fraction)
    return ArrayDataset(_cached(spec, progress), spec.eval_fraction)


def cache_path(spec: DataSpec) -> Path:
    """Where a raw source's conversion lives (see the module docstring)."""
    config = json.dumps(conversion_config(spec), sort_keys=True).encode()
    name = f"{spec.format}-{spec.hashing}-{hashlib.blake2b(config, digest_size=5).hexdigest()}"
    if spec.cache_dir:
        return Path(spec.cache_dir) / name
    source = Path(str(spec.path))
    if _writable(source.parent):
        return source.with_name(source.name + ".bagpipe") / name
    tag = hashlib.blake2b(str(source).encode(), digest_size=5).hexdigest()
    return Path.home() / ".cache" / "bagpipe" / "data" / f"{source.name}-{tag}" / name


def _writable(folder: Path) -> bool:
    """Writable, and not marked read-only: root may write anywhere, but a data folder whose
    mode denies writes (a shared read-only copy) is left as it is."""
    return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & stat.S_IWUSR)


def _cached(spec: DataSpec, progress: bool) -> Preprocessed:
    path = cache_path(spec)
    data, _ = _current(spec, path)
    if data is not None:
        return data
    with _conversion_lock(path):
        data, why_not = _current(spec, path)  # another process may have converted it meanwhile
        if data is None:
            if why_not is not None:
                log.warning("%s; converting again", why_not)
            log.info("converting %s into %s", spec.path, path)
            convert(spec, path, progress=progress)
            data = open_preprocessed(path)
    return data


def _current(spec: DataSpec, path: Path) -> tuple[Preprocessed | None, str | None]:
    """The conversion at `path` if it is current with `spec` and its source; else None, and
    why it cannot be used (None where there is no conversion at all)."""
    try:
        data = open_preprocessed(path)
    except ConfigError as exc:
        return None, f"cache unusable ({exc})" if path.exists() else None
    stale = data.manifest.source.get("files") != source_fingerprint(spec)
    if data.manifest.config == conversion_config(spec) and not stale:
        return data, None
    return None, f"{path} is out of date with its source or settings"


@contextmanager
def _conversion_lock(path: Path) -> Iterator[None]:
    """One conversion into `path` at a time, across processes: roles, runs and test workers
    started together on one source convert it once; the others wait, then open it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        yield
