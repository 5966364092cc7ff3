"""Parquet click logs (NVTabular-style: a label, dense and categorical columns), streamed.

`path` is one ``.parquet`` file or a folder of them (NVTabular's ``part_N.parquet``; its
``_metadata``, ``schema.pbtxt`` and other files are ignored), read in natural order. Every
file's schema is checked first (each configured column present, numeric; categorical ids
integer), then only those columns are read, `CHUNK_ROWS` rows at a time
(``ParquetFile.iter_batches``): a file is never loaded whole.

Values: the label must be 0 or 1. Dense columns are taken as they are
(``dense_transform = "none"``, NVTabular's output is already normalised; a missing value is
an error) or, with ``"log1p"``, as raw counts transformed like the raw Criteo reader does
(missing = 0, ``log(1 + max(x, 0))``). Categorical ids are integers >= 0, a null is missing;
with ``hashing = "none"`` they are rows and must be below their table's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.data.chunks import (
    Check, MalformedData, RawChunk, Reader, bytes_done, column_checks, id_values, label_values, row_errors,
)  # fmt: skip
from common.data.files import expand
from common.data.raw import dense_transform
from common.data.spec import DataSpec
from common.errors import ConfigError

CHUNK_ROWS = 1 << 17

# spec key -> (accepts the arrow type, what the column must hold)
_KINDS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "label_column": (lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t),
                     "the label must be an integer, float or boolean column"),
    "dense_columns": (lambda t: pa.types.is_integer(t) or pa.types.is_floating(t),
                      "dense columns must be integer or float"),
    "sparse_columns": (pa.types.is_integer, "categorical columns must hold integer ids (NVTabular's Categorify "
                       "writes them); hash strings to ids first"),
}  # fmt: skip


def parquet_files(spec: DataSpec) -> list[Path]:
    """The spec's parquet files (`common.data.files`): a file, a folder's visible
    ``.parquet`` files (NVTabular's ``_metadata`` left out), a glob pattern or a list."""
    if spec.path is None:
        raise ConfigError("data.path", "is required for format 'parquet'")
    return expand(spec.path, lambda p: p.suffix == ".parquet" and not p.name.startswith("_"), ".parquet files")


def check_schema(path: Path, spec: DataSpec) -> None:
    """MalformedData naming the file and column (and the spec key) when a configured column
    is missing, named twice or of a type it cannot have."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise MalformedData(path, None, f"is not a readable parquet file ({exc})") from None
    groups = {"label_column": (spec.label_column,), "dense_columns": spec.dense_columns,
              "sparse_columns": spec.sparse_columns}  # fmt: skip
    for key, names in groups.items():
        accepts, want = _KINDS[key]
        for name in names:
            where = schema.get_all_field_indices(name)
            if len(where) != 1:
                have = "has no" if not where else "has more than one"
                raise MalformedData(path, None, f"{have} column {name!r} (data.{key}); its columns: "
                                    f"{', '.join(schema.names[:60])}")  # fmt: skip
            if not accepts(schema.field(where[0]).type):
                raise MalformedData(path, None, f"column {name!r} is {schema.field(where[0]).type}: {want}")


def _filled(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """(values with nulls as 0, null mask or None when there are none)."""
    if not col.null_count:
        return col.to_numpy(zero_copy_only=False), None
    zero = pa.scalar(0, pa.int8()).cast(col.type)  # a plain 0 does not convert to a boolean column
    return pc.fill_null(col, zero).to_numpy(zero_copy_only=False), col.is_null().to_numpy(zero_copy_only=False)


class ParquetReader(Reader):
    """Streams `RawChunk`s from the parquet files of a spec (a `Reader`; see the module
    docstring). Opening checks every file's schema."""

    def __init__(self, spec: DataSpec, *, files: list[Path] | None = None,
                 on_bytes: Callable[[int], None] = lambda n: None) -> None:  # fmt: skip
        if spec.format != "parquet" or spec.path is None:
            raise ConfigError("data.format", f"{spec.format!r} is not parquet")
        super().__init__(on_error=spec.on_error, on_bytes=on_bytes)
        self.spec = spec
        self.files = parquet_files(spec) if files is None else files
        for file in self.files:
            check_schema(file, spec)
        self.num_dense, self.tables = len(spec.dense_columns), spec.sparse_columns
        self._sizes = spec.table_sizes if spec.hashing == "none" else None

    def chunks(self) -> Iterator[RawChunk]:
        for file in self.files:
            yield from self.file_chunks(file, None)

    def file_chunks(self, file: Path, groups: range | None) -> Iterator[RawChunk]:
        """The rows of `file` (of its row groups `groups`, when given), checked, in chunks
        of `CHUNK_ROWS`; bad rows are numbered from the file's first row."""
        columns = [self.spec.label_column, *self.spec.dense_columns, *self.spec.sparse_columns]
        source = pq.ParquetFile(file)
        meta = source.metadata
        groups = range(meta.num_row_groups) if groups is None else groups
        start = sum(meta.row_group(g).num_rows for g in range(groups.start))
        size, rows = file.stat().st_size, meta.num_rows
        for batch in source.iter_batches(batch_size=CHUNK_ROWS, columns=columns, row_groups=list(groups)):
            chunk, checks = self._parse(batch)
            errors = row_errors(start, lambda _: file)
            self.on_bytes(bytes_done(size, start + batch.num_rows, rows) - bytes_done(size, start, rows))
            start += batch.num_rows
            yield self.keep(chunk, checks, errors)

    def _parse(self, batch: pa.RecordBatch) -> tuple[RawChunk, list[Check]]:
        spec = self.spec
        label_col = batch.column(spec.label_column)
        values, missing = _filled(label_col)
        labels, label_check = label_values(spec.label_column, values, missing, label_col)
        dense, dense_checks = self._dense([batch.column(n) for n in spec.dense_columns], batch.num_rows)
        id_cols = [batch.column(n) for n in spec.sparse_columns]
        ids = np.empty((batch.num_rows, len(id_cols)), dtype=np.int64)
        missing_ids = np.zeros(ids.shape, dtype=bool)
        for j, col in enumerate(id_cols):
            values, absent = _filled(col)
            ids[:, j] = values  # a uint64 id past 2**63 wraps negative here and is refused as such
            if absent is not None:
                missing_ids[:, j] = absent
        value_ids, id_checks = id_values(spec.sparse_columns, ids, missing_ids, id_cols, self._sizes)
        return RawChunk(labels=labels, dense=dense, ids=value_ids), [label_check, *dense_checks, *id_checks]

    def _dense(self, cols: list[pa.Array], n: int) -> tuple[np.ndarray, list[Check]]:
        dense = np.empty((n, len(cols)), dtype=np.float32)
        missing = np.zeros((n, len(cols)), dtype=bool)
        for j, col in enumerate(cols):
            values, absent = _filled(col)
            with np.errstate(over="ignore"):  # a value past float32 becomes inf, refused below
                dense[:, j] = dense_transform(values) if self.spec.dense_transform == "log1p" else values
            if absent is not None and self.spec.dense_transform == "none":
                missing[:, j] = absent  # a normalised feature has no neutral value to fill in
        names = self.spec.dense_columns
        checks = column_checks(names, ~np.isfinite(dense), cols, "must be a finite number")
        return dense, checks + column_checks(names, missing, cols, "dense_transform = 'none' has no value for it")
