"""One-time conversion of a source (raw click logs, TorchRec npy days, parquet) into the
preprocessed format, with a progress bar; `open_reader` picks the source's reader."""

from __future__ import annotations

import gzip
import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice, takewhile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.data.chunks import MalformedData, Reader
from common.data.mapping import RowMapper, build_vocabularies
from common.data.npy import NpyDaysReader, day_files
from common.data.parquet import ParquetReader, parquet_files
from common.data.preprocessed import Manifest, Writer
from common.data.raw import RawReader, raw_format, source_files
from common.data.spec import DataSpec
from common.errors import ConfigError

log = logging.getLogger(__name__)


def conversion_config(spec: DataSpec) -> dict[str, Any]:
    """The settings that decide a conversion's output; a cache is reused only if they match."""
    config: dict[str, Any] = {
        "format": spec.format, "hashing": spec.hashing, "min_frequency": spec.min_frequency,
        "table_sizes": list(spec.table_sizes), "on_error": spec.on_error,
    }  # fmt: skip
    if spec.format == "criteo-npy":
        config["sparse_path"] = spec.sparse_path  # where the sparse ids come from decides them
    if spec.format == "parquet":
        config |= {"label_column": spec.label_column, "dense_columns": list(spec.dense_columns),
                   "sparse_columns": list(spec.sparse_columns), "dense_transform": spec.dense_transform}  # fmt: skip
    return config


def open_reader(spec: DataSpec, *, on_bytes: Callable[[int], None] = lambda n: None) -> Reader:
    """The reader of a source format; opening checks what can be checked before reading
    rows (npy headers and shapes, parquet schemas)."""
    if spec.format == "criteo-npy":
        return NpyDaysReader(spec, on_bytes=on_bytes)
    if spec.format == "parquet":
        return ParquetReader(spec, on_bytes=on_bytes)
    return RawReader(spec, on_bytes=on_bytes)


def source_paths(spec: DataSpec) -> list[Path]:
    """The files a source is read from, in order (without opening them)."""
    path = Path(str(spec.path))
    if spec.format == "criteo-npy":
        days = day_files(path, Path(spec.sparse_path) if spec.sparse_path else path)
        return [f for files in days for f in files.values()]
    return parquet_files(path) if spec.format == "parquet" else source_files(path)


def table_names(spec: DataSpec) -> tuple[str, ...] | None:
    """The tables' names of a source format (None for synthetic or preprocessed data)."""
    if spec.format == "parquet":
        return spec.sparse_columns
    if spec.format == "criteo-npy":
        return NpyDaysReader.tables
    return raw_format(spec).tables if spec.is_raw else None


def source_fingerprint(spec: DataSpec) -> list[dict[str, Any]]:
    """Name, size and mtime of every source file: a cheap check that a cache is still current."""
    return [{"name": p.name, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in source_paths(spec)]


def convert(spec: DataSpec, out: Path, *, progress: bool = True) -> Manifest:
    """Convert the source files of `spec` into a preprocessed directory at `out`.

    Hash and identity ("none") modes read the source once; dictionary mode twice (count,
    then map). Raises MalformedData on a bad line or row (unless ``on_error="skip"``) or
    file, and leaves no partial `out`.
    """
    probe = open_reader(spec)  # fails on a bad file before any long pass
    if spec.table_sizes and len(spec.table_sizes) != len(probe.tables):
        raise ConfigError("data.table_sizes", f"{spec.format} has {len(probe.tables)} tables, "
                          f"got {len(spec.table_sizes)} sizes")  # fmt: skip
    mapper = _mapper(spec, probe, progress)
    with Writer(out, num_dense=probe.num_dense, table_sizes=mapper.sizes) as writer:
        with _source_bar("convert", spec, progress) as bar:
            reader = open_reader(spec, on_bytes=bar.update)
            for chunk in reader.chunks():
                writer.append(chunk.labels, chunk.dense, mapper.rows(chunk.ids))
        extra = mapper.save(writer.tmp)
        source = {"files": source_fingerprint(spec), "blake2b": reader.checksum,
                  "skipped_lines": reader.skipped}  # fmt: skip
        return writer.commit(config=conversion_config(spec), source=source, extra_files=extra)


def _mapper(spec: DataSpec, probe: Reader, progress: bool) -> RowMapper:
    if spec.hashing == "hash":
        return RowMapper(sizes=spec.table_sizes, direct_tables=probe.direct_tables)
    if spec.hashing == "none":
        return RowMapper(sizes=spec.table_sizes, ids_are_rows=True)
    with _source_bar("count", spec, progress) as bar:
        reader = open_reader(spec, on_bytes=bar.update)
        vocabs = build_vocabularies(reader.chunks(), len(probe.tables), spec.min_frequency, spec.table_sizes)
    return RowMapper.for_dictionary(vocabs, spec.table_sizes)


@contextmanager
def _source_bar(description: str, spec: DataSpec, progress: bool) -> Iterator[tqdm]:
    """A bar over the source files' bytes that ends where bad data stopped the pass.

    Readers count bytes as they take them in, a block (8 MiB for text) ahead of the rows
    they have checked, so a small file's bar would read 100 % before its first error.
    """
    files = source_paths(spec)
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=description, disable=not progress) as bar:
        try:
            yield bar
        except MalformedData as exc:
            bar.n = _bytes_before(files, exc)
            raise


def _bytes_before(files: list[Path], error: MalformedData) -> int:
    """Bytes of the source files before the bad line; before its file where no line is
    known (a bad row of an array or parquet file, a bad file). In a .gz file, compressed
    bytes as far as the decompressor has read."""
    done = sum(p.stat().st_size for p in takewhile(lambda p: p != error.path, files))
    if error.line is None:
        return done
    with error.path.open("rb") as raw:
        lines = gzip.GzipFile(fileobj=raw) if error.path.suffix == ".gz" else raw
        deque(islice(lines, error.line - 1), maxlen=0)  # skip them at C speed
        return done + raw.tell()
