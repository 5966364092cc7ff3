"""Datasets: fixed-order batches for training, the held-out tail for evaluation.

`open_dataset(spec)` gives the same interface for every format, and `access` decides, once,
how a source is read:

* "in place": TorchRec's criteo-npy days (memory-mapped) and parquet files (row group by
  row group) are read where they lie, with no second copy on disk, when each row can be
  read on its own: ids hashed or taken as rows, and bad rows failing the run
  (``on_error = "fail"``; a bad row raises MalformedData naming its file and row when it is
  read). Skipping bad rows would move every later row, and a dictionary needs a pass over
  everything: those settings convert instead.
* "converted": raw click logs (criteo, criteo-terabyte, avazu), and npy days or parquet
  under the settings above, are converted once (`common.data.convert`) into the
  preprocessed format, cached in ``<path>.bagpipe/<format>-<hashing>-<config hash>/`` (or
  under `cache_dir` when the spec sets it; under ``~/.cache/bagpipe/data/`` when the
  source's folder is read-only; ``<folder>/.bagpipe/`` for a list or a glob pattern). The
  cache is reused while the conversion settings and the source files' sizes and mtimes
  match; processes that open one source together convert it once (a file lock beside the
  cache), and a conversion stopped part way resumes where it stopped. With `background`,
  `open_dataset` returns once the first file is converted and the rows of all are known;
  the rest converts while the data set is read, and a read of rows not yet converted waits
  for them (`ConvertingDataset`), in this process or another one.
* "preprocessed": a directory made by ``python -m common.data convert|synth``; a manifest
  that does not match the spec, or truncated arrays, are refused (ConfigError).
* "generated": synthetic rows, generated on the fly from the seed.

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
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import numpy as np

from common.data.files import entries, is_pattern
from common.data.preprocessed import (
    Manifest,
    Part,
    Preprocessed,
    map_part,
    open_preprocessed,
    read_part_info,
)
from common.data.spec import ID_FORMATS, DataSpec
from common.data.synthetic import CHUNK_ROWS, Rows, SyntheticGenerator
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.data.convert import Conversion

log = logging.getLogger(__name__)
Access = Literal["in place", "converted", "preprocessed", "generated"]
WAIT_POLL_S = 0.2  # how often a reader waiting for a part looks again


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


class PartsDataset(Dataset):
    """Rows kept in consecutive parts (of a preprocessed directory, or windows of a source
    read in place); a batch is a slice of one part or joins slices of two. Subclasses say
    how part k is read (`_part`)."""

    def __init__(self, part_rows: list[int], *, num_dense: int, table_sizes: tuple[int, ...],
                 eval_fraction: float) -> None:  # fmt: skip
        super().__init__(num_rows=sum(part_rows), num_dense=num_dense, table_sizes=table_sizes,
                         eval_fraction=eval_fraction)  # fmt: skip
        self._starts = np.concatenate([[0], np.cumsum(part_rows, dtype=np.int64)])

    def _part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels, dense, sparse) of part k, sparse of any integer dtype."""
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> Rows:
        stop = min(stop, self.num_rows)
        start = min(start, stop)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        k = first
        while k < len(self._starts) - 1 and (not pieces or self._starts[k] < stop):
            a, b = max(start - int(self._starts[k]), 0), min(stop, int(self._starts[k + 1])) - int(self._starts[k])
            if b > a:
                labels, dense, sparse = self._part(k)
                pieces.append((labels[a:b], dense[a:b], sparse[a:b]))
            k += 1
            if self._starts[k - 1] >= stop:
                break
        if len(pieces) == 1:
            labels, dense, sparse = pieces[0]
            return Rows(labels=np.asarray(labels), dense=np.asarray(dense), sparse=np.asarray(sparse, dtype=np.int64))
        if not pieces:
            return Rows(labels=np.empty(0, np.float32), dense=np.empty((0, self.num_dense), np.float32),
                        sparse=np.empty((0, len(self.table_sizes)), np.int64))  # fmt: skip
        return Rows(labels=np.concatenate([p[0] for p in pieces]), dense=np.concatenate([p[1] for p in pieces]),
                    sparse=np.concatenate([np.asarray(p[2], dtype=np.int64) for p in pieces]))  # fmt: skip


class ArrayDataset(PartsDataset):
    """A complete preprocessed directory, read through memmaps."""

    def __init__(self, data: Preprocessed, eval_fraction: float) -> None:
        m = data.manifest
        super().__init__([p.rows for p in m.parts], num_dense=m.num_dense, table_sizes=m.table_sizes,
                         eval_fraction=eval_fraction)  # fmt: skip
        self.data = data

    def _part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.data.arrays(k)


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


# -- the one way in ----------------------------------------------------------------------------


def access(spec: DataSpec) -> Access:
    """How `spec`'s data is read (see the module docstring): decided here, once."""
    if spec.format == "synthetic":
        return "generated"
    if spec.format == "preprocessed":
        return "preprocessed"
    if spec.format in ID_FORMATS and spec.hashing != "dictionary" and spec.on_error == "fail":
        return "in place"
    return "converted"


def open_dataset(spec: DataSpec, *, progress: bool = False, background: bool = False) -> Dataset:
    """The data set a spec describes, read as `access` decides; converts a source into its
    cache on first use (a bar on stderr with `progress`). With `background`, returns as
    soon as training can start and converts the rest meanwhile: the returned data set's
    `conversion` is then the running `BackgroundConversion` (None when nothing was left)."""
    how = access(spec)
    if how == "generated":
        return SyntheticDataset(spec)
    if how == "preprocessed":
        data = open_preprocessed(Path(str(spec.path)))
        if spec.table_sizes and spec.table_sizes != data.manifest.table_sizes:
            raise ConfigError("data.table_sizes", f"{spec.table_sizes} does not match "
                              f"{data.manifest.table_sizes} in {spec.path}")  # fmt: skip
        return ArrayDataset(data, spec.eval_fraction)
    if how == "in place":
        from common.data.in_place import open_in_place

        return open_in_place(spec)
    return _converted(spec, progress, background)


def cache_path(spec: DataSpec) -> Path:
    """Where a source's conversion lives (see the module docstring)."""
    from common.data.convert import conversion_config

    named = entries(spec.path) if spec.path is not None else ()
    several = len(named) != 1 or is_pattern(named[0])
    config = conversion_config(spec) | ({"path": list(named)} if several else {})
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=5).hexdigest()
    name = f"{spec.format}-{spec.hashing}-{digest}"
    if spec.cache_dir:
        return Path(spec.cache_dir) / name
    source = Path(named[0])
    folder = _first_plain_folder(source) if several else source.parent
    if _writable(folder):
        return (folder / ".bagpipe" if several else source.with_name(source.name + ".bagpipe")) / name
    tag = hashlib.blake2b("\0".join(named).encode(), digest_size=5).hexdigest()
    return Path.home() / ".cache" / "bagpipe" / "data" / f"{source.name if not several else 'sources'}-{tag}" / name


def _first_plain_folder(path: Path) -> Path:
    """The deepest folder of a pattern above its first glob character."""
    while is_pattern(str(path)):
        path = path.parent
    return path if path.is_dir() else path.parent


def _writable(folder: Path) -> bool:
    """Writable, and not marked read-only: root may write anywhere, but a data folder whose
    mode denies writes (a shared read-only copy) is left as it is."""
    return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & stat.S_IWUSR)


def _converted(spec: DataSpec, progress: bool, background: bool) -> Dataset:
    from common.data.convert import Conversion

    path = cache_path(spec)
    data, _ = _current(spec, path)
    if data is not None:
        return ArrayDataset(data, spec.eval_fraction)
    lock = _conversion_lock(path)
    if lock is None:  # another process converts it: read along once its rows are known, or wait
        return ConvertingDataset.wait_for(spec, path)
    try:
        data, why_not = _current(spec, path)  # another process may have converted it meanwhile
        if data is not None:
            return ArrayDataset(data, spec.eval_fraction)
        if why_not is not None:
            log.warning("%s; converting again", why_not)
        log.info("converting %s into %s", spec.path, path)
        job = Conversion(spec, path, progress=progress)
        if not background:
            job.run()
            return ArrayDataset(open_preprocessed(path), spec.eval_fraction)
        running = BackgroundConversion(job, lock)
        lock = None  # the conversion's thread holds it now
        running.wait_ready()
        return ConvertingDataset(spec, path, conversion=running)
    finally:
        if lock is not None:
            lock.close()


def _current(spec: DataSpec, path: Path) -> tuple[Preprocessed | None, str | None]:
    """The conversion at `path` if it is current with `spec` and its source; else None, and
    why it cannot be used (None where there is no conversion at all)."""
    from common.data.convert import conversion_config, source_fingerprint

    try:
        data = open_preprocessed(path)
    except ConfigError as exc:
        return None, f"cache unusable ({exc})" if (path / "manifest.json").exists() else None
    stale = data.manifest.source.get("files") != source_fingerprint(spec)
    if data.manifest.config == conversion_config(spec) and not stale:
        return data, None
    return None, f"{path} is out of date with its source or settings"


def _conversion_lock(path: Path) -> IO[str] | None:
    """The lock of conversions into `path`, held while the returned file is open, or None
    at once when another process holds it: roles, runs and test workers started together on
    one source convert it once, and the others read along (`ConvertingDataset.wait_for`).
    Released when its file closes, or its process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = (path.parent / f".{path.name}.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def _converter_gone(path: Path) -> bool:
    """Whether no process holds the conversion lock of `path` (tested without waiting)."""
    lock = _conversion_lock(path)
    if lock is None:
        return False
    lock.close()
    return True


class BackgroundConversion:
    """A `Conversion` running in a thread of this process, holding the conversion lock;
    `wait_ready` returns once readers can start (or raises the conversion's error)."""

    def __init__(self, job: Conversion, lock: IO[str]) -> None:
        self.job, self._lock = job, lock
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.manifest: Manifest | None = None
        self._thread = threading.Thread(target=self._run, name="data-conversion", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.manifest = self.job.run(ready=self._ready.set)
        except BaseException as exc:
            self.error = exc
        finally:
            self._lock.close()
            self._ready.set()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait_ready(self) -> None:
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def join(self) -> Manifest:
        """Wait for the end; the conversion's error if it failed."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.manifest is not None
        return self.manifest

    def stop(self) -> None:
        """Stop after the pieces in hand (what is done is kept for the next run) and wait."""
        self.job.stop()
        self._thread.join()


class ConvertingDataset(PartsDataset):
    """A conversion still running (here or in another process), read as its parts are
    written: a read of rows not converted yet waits for their part. The rows of every part
    are known before the first is read (`rows.json`), so the data set's length is exact."""

    def __init__(self, spec: DataSpec, path: Path, *, conversion: BackgroundConversion | None = None) -> None:
        from common.data.convert import PLAN, ROWS, num_dense_of, read_json

        plan, rows = read_json(path / PLAN), json.loads((path / ROWS).read_text())
        assert plan is not None
        self.path, self.conversion = path, conversion
        names = [f"parts/{u['key']}/{i:05d}" for u in plan["units"] for i in range(len(u["pieces"]))]
        self._parts = [Part(name=name, rows=n) for name, n in zip(names, rows, strict=True)]
        self._ranges = [p for u in plan["units"] for p in u["pieces"]]
        sizes = self._sizes(spec, path)
        super().__init__([p.rows for p in self._parts], num_dense=num_dense_of(spec), table_sizes=sizes,
                         eval_fraction=spec.eval_fraction)  # fmt: skip
        self._open: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    @staticmethod
    def _sizes(spec: DataSpec, path: Path) -> tuple[int, ...]:
        if spec.hashing != "dictionary" or spec.table_sizes:
            return spec.table_sizes
        from common.data.convert import table_names

        tables = range(len(table_names(spec) or ()))
        return tuple(2 + len(np.load(path / f"vocab_{t}.npy", mmap_mode="r")[0]) for t in tables)

    @classmethod
    def wait_for(cls, spec: DataSpec, path: Path) -> Dataset:
        """The data set of the conversion another process is running into `path`: as soon
        as the rows of its every part are known (it converts in the background), else once
        it is complete. If that process stops first, this one converts."""
        from common.data.convert import ROWS, failure

        while True:
            data, _ = _current(spec, path)
            if data is not None:
                return ArrayDataset(data, spec.eval_fraction)
            if (path / ROWS).is_file():
                return cls(spec, path)
            if (error := failure(path)) is not None:
                raise error
            if _converter_gone(path):  # it stopped before its rows were known: convert here
                return open_dataset(spec)
            time.sleep(WAIT_POLL_S)

    def _part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if k not in self._open:
            self._wait_for_part(k)
            if len(self._open) >= 8:
                self._open.popitem(last=False)
            self._open[k] = map_part(self.path / self._parts[k].name, self._parts[k].rows, self.num_dense,
                                     self.table_sizes)  # fmt: skip
        self._open.move_to_end(k)
        labels, dense, sparse = self._open[k]
        return labels, dense, sparse

    def _wait_for_part(self, k: int) -> None:
        from common.data.convert import failure

        folder = self.path / self._parts[k].name
        waited = 0.0
        while True:
            info = read_part_info(folder)
            if info is not None and info.get("range") == self._ranges[k][:2]:
                return
            if (error := failure(self.path)) is not None:
                raise error
            if self.conversion is not None and self.conversion.done and self.conversion.error is not None:
                raise self.conversion.error
            if self.conversion is None and _converter_gone(self.path):
                raise ConfigError("data.path", f"the conversion into {self.path} stopped before "
                                  f"{self._parts[k].name} was written; run again to resume it")  # fmt: skip
            if waited == 0.0:
                log.info("waiting for %s to be converted", self._parts[k].name)
            time.sleep(WAIT_POLL_S)
            waited += WAIT_POLL_S
