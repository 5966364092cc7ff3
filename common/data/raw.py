"""Streaming readers for the raw click logs: Criteo Kaggle/Terabyte TSV and Avazu CSV.

Files are read by pyarrow's streaming CSV reader in blocks of a few MiB, every column as a
string, then validated and converted with vectorised numpy/pyarrow code: memory stays
bounded whatever the file size. A malformed line (wrong field count, bad label, integer or
hex value, bad Avazu hour) raises `MalformedData` naming the file and line, or, with
``on_error="skip"``, is dropped and counted; it is never mis-parsed.

A chunk carries categorical *value ids* (uint64, `hashing.MISSING` for an empty field),
not rows: `common.data.mapping` turns them into rows.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from common.data.chunks import Check, MalformedData, RawChunk, Reader, natural_order
from common.data.hashing import hash_strings, parse_hex8
from common.data.spec import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, DataSpec
from common.errors import ConfigError

log = logging.getLogger(__name__)
BLOCK_BYTES = 8 << 20
_INT_RE = r"^-?[0-9]{1,18}$"
_HOUR_RE = r"^[0-9]{8}$"


@dataclass(frozen=True, kw_only=True)
class _Parsed:
    chunk: RawChunk
    bad: list[tuple[str, np.ndarray]]  # (column name, bad-row mask) per checked column


CRITEO_COLUMNS = ("label", *CRITEO_DENSE_NAMES, *CRITEO_SPARSE_NAMES)
AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", *(f"C{i}" for i in range(14, 22)),
)  # fmt: skip
AVAZU_TABLES = ("hour_of_day", "weekday", *AVAZU_COLUMNS[3:])


def _labels(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    one = pc.fill_null(pc.equal(col, "1"), False).to_numpy(zero_copy_only=False)
    zero = pc.fill_null(pc.equal(col, "0"), False).to_numpy(zero_copy_only=False)
    return one.astype(np.float32), ~(one | zero)


def _integers(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values with nulls as 0, bad mask). Regex only runs when the fast cast fails."""
    try:
        values = pc.cast(col, pa.int64())
        bad = np.zeros(len(col), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        ok = pc.fill_null(pc.match_substring_regex(col, _INT_RE), True)
        bad = ~ok.to_numpy(zero_copy_only=False)
        values = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.int64())
    return pc.fill_null(values, 0).to_numpy(zero_copy_only=False), bad


def dense_transform(values: np.ndarray) -> np.ndarray:
    """DLRM's dense transform: log(1 + max(x, 0)) in float32 (missing is already 0)."""
    return np.log1p(np.maximum(values, 0).astype(np.float32))


def _parse_criteo(batch: pa.RecordBatch) -> _Parsed:
    labels, bad_label = _labels(batch.column(0))
    dense = np.empty((batch.num_rows, 13), dtype=np.float32)
    ids = np.empty((batch.num_rows, 26), dtype=np.uint64)
    bad = [("label", bad_label)]
    for j in range(13):
        values, b = _integers(batch.column(1 + j))
        dense[:, j] = dense_transform(values)
        bad.append((CRITEO_COLUMNS[1 + j], b))
    for j in range(26):
        ids[:, j], b = parse_hex8(batch.column(14 + j))
        bad.append((CRITEO_COLUMNS[14 + j], b))
    return _Parsed(chunk=RawChunk(labels=labels, dense=dense, ids=ids), bad=bad)


def _avazu_hour(col: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """YYMMDDHH → (hour of day, weekday Monday=0, bad mask); calendar-checked."""
    ok = pc.fill_null(pc.match_substring_regex(col, _HOUR_RE), False)
    bad = ~ok.to_numpy(zero_copy_only=False)
    v = pc.fill_null(pc.cast(pc.if_else(ok, col, "14010100"), pa.int64()), 0).to_numpy()
    yy, mm, dd, hh = v // 1_000_000, v // 10_000 % 100, v // 100 % 100, v % 100
    bad |= (mm < 1) | (mm > 12) | (dd < 1) | (hh > 23)
    mm, dd = np.where(bad, 1, mm), np.where(bad, 1, dd)
    month = (yy + 30).astype("datetime64[Y]") + (mm - 1).astype("timedelta64[M]")
    day = month.astype("datetime64[D]") + (dd - 1).astype("timedelta64[D]")
    bad |= day.astype("datetime64[M]") != month  # e.g. 31 February
    weekday = (day.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday
    return hh.astype(np.uint64), weekday.astype(np.uint64), bad


def _parse_avazu(batch: pa.RecordBatch) -> _Parsed:
    labels, bad_label = _labels(batch.column("click"))
    ids = np.empty((batch.num_rows, len(AVAZU_TABLES)), dtype=np.uint64)
    ids[:, 0], ids[:, 1], bad_hour = _avazu_hour(batch.column("hour"))
    for j, name in enumerate(AVAZU_TABLES[2:], start=2):
        ids[:, j] = hash_strings(batch.column(name))
    dense = np.empty((batch.num_rows, 0), dtype=np.float32)
    chunk = RawChunk(labels=labels, dense=dense, ids=ids)
    return _Parsed(chunk=chunk, bad=[("click", bad_label), ("hour", bad_hour)])


@dataclass(frozen=True, kw_only=True)
class RawFormat:
    """What a raw format looks like on disk and how one arrow batch is parsed."""

    name: str
    columns: tuple[str, ...]
    delimiter: str
    header: bool  # files normally start with a header line (one may be missing: see RawReader)
    label: str  # the label column, which tells a data line from a header
    num_dense: int
    tables: tuple[str, ...]
    direct_tables: tuple[int, ...]  # tables whose value ids are small integers (hash mode)
    parse: Callable[[pa.RecordBatch], _Parsed] = field(repr=False)


CRITEO = RawFormat(
    name="criteo", columns=CRITEO_COLUMNS, delimiter="\t", header=False, label="label", num_dense=13,
    tables=CRITEO_COLUMNS[14:], direct_tables=(), parse=_parse_criteo,
)  # fmt: skip
AVAZU = RawFormat(
    name="avazu", columns=AVAZU_COLUMNS, delimiter=",", header=True, label="click", num_dense=0,
    tables=AVAZU_TABLES, direct_tables=(0, 1), parse=_parse_avazu,
)  # fmt: skip


def raw_format(spec: DataSpec) -> RawFormat:
    return AVAZU if spec.format == "avazu" else CRITEO


def source_files(path: Path) -> list[Path]:
    """The files of a raw source: `path` itself, or a folder's visible files in natural order
    (``day_2`` before ``day_10``). ConfigError if there is nothing to read."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError("data.path", f"{path} does not exist")
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise ConfigError("data.path", f"{path} holds no data files")
    return natural_order(files)


class _Tap(io.RawIOBase):
    """A read-only file that feeds every byte read to a checksum and a progress callback."""

    def __init__(self, f: BinaryIO, digest: hashlib._Hash, on_bytes: Callable[[int], None]) -> None:
        self._f, self._digest, self._on_bytes = f, digest, on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = self._f.readinto(buf)
        if n:
            view = memoryview(buf)[:n]
            self._digest.update(view)
            self._on_bytes(n)
        return n or 0


class RawReader(Reader):
    """Streams `RawChunk`s from the files of a raw spec, in file order (a `Reader`)."""

    def __init__(self, spec: DataSpec, *, on_bytes: Callable[[int], None] = lambda n: None) -> None:
        if not spec.is_raw or spec.path is None:
            raise ConfigError("data.format", f"{spec.format!r} is not a raw format")
        super().__init__(on_error=spec.on_error, on_bytes=on_bytes)
        self.spec, self.fmt = spec, raw_format(spec)
        self.files = source_files(Path(spec.path))
        self.num_dense, self.tables, self.direct_tables = self.fmt.num_dense, self.fmt.tables, self.fmt.direct_tables

    def chunks(self) -> Iterator[RawChunk]:
        for path in self.files:
            yield from self._file_chunks(path)
        if self.skipped:
            log.warning("skipped %d malformed line(s) in %s", self.skipped, self.spec.path)

    def _file_chunks(self, path: Path) -> Iterator[RawChunk]:
        rejected: list[str] = []
        header = self._header_lines(path)
        lines_done = header  # lines before the current block, exact in fail mode
        with path.open("rb") as f:
            source: pcsv.CSVStreamingReader | None = None
            while True:
                try:  # opening parses the first block, so it can fail like any read
                    source = source or self._open(path, f, rejected, header)
                    batch = source.read_next_batch()
                except StopIteration:
                    return
                except pa.ArrowInvalid as exc:
                    raise self._field_count_error(path, lines_done, rejected, exc) from None
                chunk = self._validate(path, batch, lines_done)
                lines_done += batch.num_rows
                yield chunk

    def _open(self, path: Path, f: BinaryIO, rejected: list[str], header: int) -> pcsv.CSVStreamingReader:
        stream: object = io.BufferedReader(_Tap(f, self.digest, self.on_bytes), 1 << 20)
        if path.suffix == ".gz":
            stream = gzip.GzipFile(fileobj=stream)  # type: ignore[arg-type]

        def on_invalid(row: pcsv.InvalidRow) -> str:
            rejected.append(row.text)
            if self.spec.on_error == "skip":
                self.skipped += 1
                return "skip"
            return "error"

        names = list(self.fmt.columns)
        return pcsv.open_csv(
            stream,
            read_options=pcsv.ReadOptions(column_names=names, block_size=BLOCK_BYTES, skip_rows=header),
            parse_options=pcsv.ParseOptions(
                delimiter=self.fmt.delimiter, quote_char=False, ignore_empty_lines=False,
                invalid_row_handler=on_invalid,
            ),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.string() for c in names}, strings_can_be_null=True,
                null_values=[""], include_columns=[c for c in names if c != "id"],
            ),
        )  # fmt: skip

    def _header_lines(self, path: Path) -> int:
        """Header lines to skip: 1 when the file starts with the format's header, 0 when a
        header-format file starts with a data line instead (split files made from Avazu's
        train.csv often have none). Anything else is refused, saying what line 1 holds."""
        if not self.fmt.header:
            return 0
        with _open_text(path) as f:
            first = f.readline().rstrip("\r\n")
        fields = first.split(self.fmt.delimiter)
        if fields == list(self.fmt.columns):
            return 1
        label = self.fmt.columns.index(self.fmt.label)
        if len(fields) == len(self.fmt.columns) and fields[label] in ("0", "1"):
            log.warning("%s has no header line: read as headerless (line 1 is data)", path)
            return 0
        if fields == [c for c in self.fmt.columns if c != self.fmt.label]:
            why = f"this is the header of an unlabelled test file (no {self.fmt.label} column): nothing to train on"
        else:
            why = f"header is not the {self.fmt.name} header, nor is line 1 a data line"
        raise MalformedData(path, 1, f"{why}: {first[:200]!r}")

    def _validate(self, path: Path, batch: pa.RecordBatch, lines_done: int) -> RawChunk:
        parsed = self.fmt.parse(batch)
        checks = [Check(column=name, mask=mask, values=batch.column(name)) for name, mask in parsed.bad]
        return self.keep(parsed.chunk, checks, lambda i, c: MalformedData(path, lines_done + i + 1, c.describe(i)))

    def _field_count_error(
        self, path: Path, lines_done: int, rejected: list[str], exc: Exception
    ) -> MalformedData:
        if not rejected:
            return MalformedData(path, None, str(exc))
        want = len(self.fmt.columns)
        line = _find_line(path, lines_done, rejected[0])
        got = rejected[0].count(self.fmt.delimiter) + 1
        return MalformedData(path, line, f"expected {want} fields, got {got}: {rejected[0][:120]!r}")


def _open_text(path: Path) -> TextIO:
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, "rt", encoding="utf-8", errors="replace", newline="")  # type: ignore[operator, no-any-return]


def _find_line(path: Path, after: int, text: str) -> int | None:
    """1-based number of the first line after line `after` equal to `text` (error path only)."""
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if number > after and line.rstrip("\r\n") == text:
                return number
    return None
