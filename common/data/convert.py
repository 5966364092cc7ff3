"""One-time conversion of raw click logs into the preprocessed format (with a progress bar)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.data.mapping import RowMapper, build_vocabularies
from common.data.preprocessed import Manifest, Writer
from common.data.raw import RawReader, raw_format, source_files
from common.data.spec import DataSpec
from common.errors import ConfigError

log = logging.getLogger(__name__)


def conversion_config(spec: DataSpec) -> dict[str, Any]:
    """The settings that decide a conversion's output; a cache is reused only if they match."""
    return {
        "format": spec.format, "hashing": spec.hashing, "min_frequency": spec.min_frequency,
        "table_sizes": list(spec.table_sizes), "on_error": spec.on_error,
    }  # fmt: skip


def source_fingerprint(spec: DataSpec) -> list[dict[str, Any]]:
    """Name, size and mtime of every raw file: a cheap check that a cache is still current."""
    files = source_files(Path(str(spec.path)))
    return [{"name": p.name, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]


def convert(spec: DataSpec, out: Path, *, progress: bool = True) -> Manifest:
    """Convert the raw files of `spec` into a preprocessed directory at `out`.

    Hash mode reads the source once; dictionary mode twice (count, then map). Raises
    MalformedData on a bad line (unless ``on_error="skip"``) and leaves no partial `out`.
    """
    fmt = raw_format(spec)
    if spec.table_sizes and len(spec.table_sizes) != len(fmt.tables):
        raise ConfigError("data.table_sizes", f"{spec.format} has {len(fmt.tables)} tables, "
                          f"got {len(spec.table_sizes)} sizes")  # fmt: skip
    total = sum(f["bytes"] for f in source_fingerprint(spec))
    mapper = _mapper(spec, total, progress)
    with Writer(out, num_dense=fmt.num_dense, table_sizes=mapper.sizes) as writer:
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
            reader = RawReader(spec, on_bytes=bar.update)
            for chunk in reader.chunks():
                writer.append(chunk.labels, chunk.dense, mapper.rows(chunk.ids))
        extra = mapper.save(writer.tmp)
        source = {"files": source_fingerprint(spec), "blake2b": reader.checksum,
                  "skipped_lines": reader.skipped}  # fmt: skip
        return writer.commit(config=conversion_config(spec), source=source, extra_files=extra)


def _mapper(spec: DataSpec, total_bytes: int, progress: bool) -> RowMapper:
    fmt = raw_format(spec)
    if spec.hashing == "hash":
        return RowMapper(sizes=spec.table_sizes, direct_tables=fmt.direct_tables)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="count", disable=not progress) as bar:
        reader = RawReader(spec, on_bytes=bar.update)
        vocabs = build_vocabularies(reader.chunks(), len(fmt.tables), spec.min_frequency, spec.table_sizes)
    return RowMapper.for_dictionary(vocabs, spec.table_sizes)
