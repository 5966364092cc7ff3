"""Sources read where they lie: TorchRec's npy days (memory-mapped) and parquet files (row
group by row group), with no second copy on disk (`dataset.access` says when).

The data set is cut into windows of at most `WINDOW_ROWS` rows (a day's rows, a row group's
rows); a window is read, checked by the format's reader (the same rules as a conversion:
a bad row raises MalformedData naming its file and row) and mapped to rows (hash, or ids as
rows) when first read, and the last two are kept, so consecutive batches cost one read. The
rows are those a conversion would have written, bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.chunks import RawChunk, row_errors
from common.data.dataset import PartsDataset
from common.data.mapping import RowMapper
from common.data.npy import CRITEO_SPARSE_NAMES, NpyPiece, day_chunks, day_files
from common.data.spec import DataSpec
from common.errors import ConfigError

WINDOW_ROWS = 1 << 16
KEPT_WINDOWS = 2


@dataclass(frozen=True, kw_only=True)
class Window:
    unit: int  # the npy day or parquet file
    group: int  # the parquet row group (0 for npy)
    start: int  # first row: in the day (npy), in the row group (parquet)
    rows: int


class InPlaceDataset(PartsDataset):
    """A source read in place, window by window (see the module docstring)."""

    def __init__(self, spec: DataSpec, windows: list[Window], num_dense: int, tables: int) -> None:
        if spec.table_sizes and len(spec.table_sizes) != tables:
            raise ConfigError("data.table_sizes", f"{spec.format} has {tables} tables, "
                              f"got {len(spec.table_sizes)} sizes")  # fmt: skip
        super().__init__([w.rows for w in windows], num_dense=num_dense, table_sizes=spec.table_sizes,
                         eval_fraction=spec.eval_fraction)  # fmt: skip
        self.spec, self.windows = spec, windows
        self.mapper = RowMapper(sizes=spec.table_sizes, ids_are_rows=spec.hashing == "none")
        self._kept: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if k not in self._kept:
            if len(self._kept) >= KEPT_WINDOWS:
                self._kept.popitem(last=False)
            chunk = self._read(self.windows[k])
            self._kept[k] = (chunk.labels, chunk.dense, self.mapper.rows(chunk.ids))
        self._kept.move_to_end(k)
        return self._kept[k]

    def _read(self, window: Window) -> RawChunk:
        raise NotImplementedError


class NpyDataset(InPlaceDataset):
    def __init__(self, spec: DataSpec) -> None:
        if not isinstance(spec.path, str):
            raise ConfigError("data.path", "criteo-npy reads one folder of day_N_*.npy files")
        folder = Path(spec.path)
        self.days = day_files(folder, Path(spec.sparse_path) if spec.sparse_path else folder)
        self.readers = [NpyPiece(spec, files, 0, 0) for files in self.days]  # maps and checks every day
        windows = [Window(unit=d, group=0, start=a, rows=min(WINDOW_ROWS, r.day.rows - a))
                   for d, r in enumerate(self.readers) for a in range(0, r.day.rows, WINDOW_ROWS)]  # fmt: skip
        super().__init__(spec, windows, NpyPiece.num_dense, len(CRITEO_SPARSE_NAMES))

    def _read(self, window: Window) -> RawChunk:
        reader = self.readers[window.unit]  # its day mapped once, when the data set opened
        return _one(day_chunks(reader, reader.day, window.start, window.start + window.rows))


class ParquetDataset(InPlaceDataset):
    def __init__(self, spec: DataSpec) -> None:
        import pyarrow.parquet as pq

        from common.data.parquet import ParquetReader

        self.reader = ParquetReader(spec)  # checks every file's schema
        self.columns = [spec.label_column, *spec.dense_columns, *spec.sparse_columns]
        windows: list[Window] = []
        self._group_starts: list[list[int]] = []
        for f, file in enumerate(self.reader.files):
            meta = pq.ParquetFile(file).metadata
            groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._group_starts.append([0, *np.cumsum(groups).tolist()])
            windows += [Window(unit=f, group=g, start=a, rows=min(WINDOW_ROWS, n - a))
                        for g, n in enumerate(groups) for a in range(0, n, WINDOW_ROWS)]  # fmt: skip
        super().__init__(spec, windows, len(spec.dense_columns), len(spec.sparse_columns))
        self._cursor: tuple[tuple[int, int], int, object] | None = None  # (file, group), next start, batches

    def _read(self, window: Window) -> RawChunk:
        import pyarrow.parquet as pq

        key = (window.unit, window.group)
        if self._cursor is None or self._cursor[0] != key or self._cursor[1] > window.start:
            source = pq.ParquetFile(self.reader.files[window.unit])
            batches = source.iter_batches(batch_size=WINDOW_ROWS, columns=self.columns, row_groups=[window.group])
            self._cursor = (key, 0, batches)
        _, at, batches = self._cursor
        while True:  # the group's batches are its windows, in order (pyarrow cuts them exactly)
            batch = next(batches)  # type: ignore[call-overload]
            if at == window.start:
                break
            at += batch.num_rows
        self._cursor = (key, at + batch.num_rows, batches)
        chunk, checks = self.reader._parse(batch)
        first = self._group_starts[window.unit][window.group] + window.start
        file = self.reader.files[window.unit]
        return self.reader.keep(chunk, checks, row_errors(first, lambda _: file))


def _one(chunks_of_window: Iterator[RawChunk]) -> RawChunk:
    chunks = list(chunks_of_window)
    if len(chunks) == 1:
        return chunks[0]
    return RawChunk(labels=np.concatenate([c.labels for c in chunks]), dense=np.concatenate([c.dense for c in chunks]),
                    ids=np.concatenate([c.ids for c in chunks]))  # fmt: skip


def open_in_place(spec: DataSpec) -> InPlaceDataset:
    return NpyDataset(spec) if spec.format == "criteo-npy" else ParquetDataset(spec)
