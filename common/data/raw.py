"""Readers for the raw click logs: Criteo Kaggle/Terabyte TSV and Avazu CSV, plain or `.gz`.

A file is cut into pieces (`split_file`): runs of whole lines of about a given size (at
most `PIECE_BYTES`; a ``.gz`` file, which cannot be entered in the middle, is one piece),
which conversion workers read side by side. A piece is read in blocks of whole lines, `BLOCK_BYTES` or so:
memory stays bounded whatever the file size. Criteo blocks are parsed by a compiled kernel
(`common.data.kernels.parse_criteo`), Avazu blocks by pyarrow's CSV reader with every
column a string, then checked and converted with vectorised numpy/pyarrow code.

The rules a Criteo line follows: 40 tab-separated fields; the label ``0`` or ``1``; 13
integers (``-?[0-9]+`` within int64; empty is missing, read as 0); 26 values of exactly 8
hex digits (either case; empty is missing). ``\\r\\n`` ends a line as ``\\n`` does; an empty
line is a line whose label is missing. A malformed line (these rules, a wrong field count,
a bad Avazu hour) raises `MalformedData` naming the file and line, the first one in file
order whichever piece it is in, or, with ``on_error="skip"``, is dropped and counted; it
is never mis-parsed.

A chunk carries categorical *value ids* (uint64, `hashing.MISSING` for an empty field),
not rows: `common.data.mapping` turns them into rows.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from common.data.chunks import Check, MalformedData, RawChunk, Reader, screen
from common.data.files import expand
from common.data.hashing import hash_strings
from common.data.spec import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, DataSpec
from common.errors import ConfigError

log = logging.getLogger(__name__)
BLOCK_BYTES = 8 << 20
PIECE_BYTES = 512 << 20  # about 2 M Criteo lines: seconds of one worker's time
_HOUR_RE = r"^[0-9]{8}$"

CRITEO_COLUMNS = ("label", *CRITEO_DENSE_NAMES, *CRITEO_SPARSE_NAMES)
AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", *(f"C{i}" for i in range(14, 22)),
)  # fmt: skip
AVAZU_TABLES = ("hour_of_day", "weekday", *AVAZU_COLUMNS[3:])


@dataclass(frozen=True, kw_only=True)
class Block:
    """One block of lines parsed: its good rows, its lines, the bad ones dropped (skip
    mode) and, in fail mode, the first bad line (0-based in the block) and what is wrong."""

    chunk: RawChunk
    lines: int
    skipped: int = 0
    error: tuple[int, str] | None = None


#: How `dense_transform` rounds, in the settings of a conversion (`conversion_config`): a
#: cache converted by a version that rounded otherwise (numpy's float32 log1p) is redone.
DENSE_ROUNDING = "float64-log1p-checked"
#: Float64 ulps around a float32 rounding midpoint within which `dense_transform` decides in
#: long double: more than any float64 log1p's error (SVML's and glibc's are within one or two).
_NEAR_ULPS = 8
#: A float64's mantissa bits below float32's (29 of them), and their value at a float32
#: rounding midpoint: the one bit of the first of them.
_BELOW_FLOAT32, _MIDPOINT = np.int64((1 << 29) - 1), np.int64(1 << 28)
_SMALLEST_NORMAL32 = float(np.finfo(np.float32).tiny)


def dense_transform(values: np.ndarray) -> np.ndarray:
    """DLRM's dense transform: log(1 + max(x, 0)) of each value as float32 (missing is already
    0), the same bits on every CPU.

    numpy picks its log1p by the CPU (SVML on AVX-512, the C library's elsewhere), and their
    float32 results differ in the last bit: converted data would depend on the machine. So
    the log is taken in float64, where implementations differ by an ulp or two, and rounded
    to float32; a result within `_NEAR_ULPS` of a float32 rounding midpoint, which an ulp
    could round either way, is taken again in long double (x87 here, the same on every
    x86-64), as is one too small for float32's normal range."""
    x = np.maximum(values, 0).astype(np.float32)
    y = np.log1p(x, dtype=np.float64)
    near = np.abs((y.view(np.int64) & _BELOW_FLOAT32) - _MIDPOINT) <= _NEAR_ULPS
    near |= (y < _SMALLEST_NORMAL32) & (y > 0)
    out = y.astype(np.float32)
    if near.any():
        out[near] = np.log1p(x[near].astype(np.longdouble)).astype(np.float32)
    return out


def _parse_criteo(block: bytes, skip: bool) -> Block:
    from common.data import kernels  # here: numba is for processes that convert

    n = block.count(b"\n") + (not block.endswith(b"\n"))
    labels, ints = np.empty(n, np.float32), np.empty((n, 13), np.int64)
    ids = np.empty((n, 26), np.uint64)
    rows, lines, skipped, bad, code, column, a, b = kernels.parse_criteo(
        np.frombuffer(block, np.uint8), skip, labels, ints, ids
    )
    chunk = RawChunk(labels=labels[:rows], dense=dense_transform(ints[:rows]), ids=ids[:rows])
    if bad < 0 or skip:
        return Block(chunk=chunk, lines=lines, skipped=skipped)
    text = block[a:b].decode("utf-8", errors="replace")
    if code == kernels.FIELD_COUNT:
        why = f"expected {len(CRITEO_COLUMNS)} fields, got {column}: {text[:120]!r}"
    elif code == kernels.MISSING_LABEL:
        why = "bad label value: missing"
    else:
        why = f"bad {CRITEO_COLUMNS[column]} value {text!r}"
    return Block(chunk=chunk, lines=lines, error=(bad, why))


def _labels(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    one = pc.fill_null(pc.equal(col, "1"), False).to_numpy(zero_copy_only=False)
    zero = pc.fill_null(pc.equal(col, "0"), False).to_numpy(zero_copy_only=False)
    return one.astype(np.float32), ~(one | zero)


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


def _parse_avazu(block: bytes, skip: bool) -> Block:
    names = list(AVAZU_COLUMNS)
    rejected: list[str] = []

    def on_invalid(row: pcsv.InvalidRow) -> str:
        rejected.append(row.text)
        return "skip" if skip else "error"

    try:
        table = pcsv.read_csv(
            pa.py_buffer(block),
            read_options=pcsv.ReadOptions(column_names=names, block_size=max(len(block), 1) + 1, use_threads=False),
            parse_options=pcsv.ParseOptions(delimiter=",", quote_char=False, ignore_empty_lines=False,
                                            invalid_row_handler=on_invalid),
            convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in names}, strings_can_be_null=True,
                                                null_values=[""], include_columns=names[1:]),
        )  # fmt: skip
    except pa.ArrowInvalid as exc:
        return _avazu_field_count(block, rejected, exc)
    batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
    if batch is None:
        empty = RawChunk(labels=np.empty(0, np.float32), dense=np.empty((0, 0), np.float32),
                         ids=np.empty((0, len(AVAZU_TABLES)), np.uint64))  # fmt: skip
        return Block(chunk=empty, lines=len(rejected), skipped=len(rejected))
    labels, bad_label = _labels(batch.column("click"))
    ids = np.empty((batch.num_rows, len(AVAZU_TABLES)), dtype=np.uint64)
    ids[:, 0], ids[:, 1], bad_hour = _avazu_hour(batch.column("hour"))
    for j, name in enumerate(AVAZU_TABLES[2:], start=2):
        ids[:, j] = hash_strings(batch.column(name))
    chunk = RawChunk(labels=labels, dense=np.empty((batch.num_rows, 0), dtype=np.float32), ids=ids)
    checks = [Check(column="click", mask=bad_label, values=batch.column("click")),
              Check(column="hour", mask=bad_hour, values=batch.column("hour"))]  # fmt: skip
    lines = batch.num_rows + len(rejected)
    errors: list[tuple[int, str]] = []

    def error_at(i: int, check: Check) -> MalformedData:
        errors.append((i, check.describe(i)))  # fail mode: every line is a row, so i is the line
        return MalformedData(Path(), None, "")

    try:
        chunk, dropped = screen(chunk, checks, on_error="skip" if skip else "fail", error_at=error_at)
    except MalformedData:
        return Block(chunk=chunk, lines=lines, error=errors[0])
    return Block(chunk=chunk, lines=lines, skipped=dropped + len(rejected))


def _avazu_field_count(block: bytes, rejected: list[str], exc: Exception) -> Block:
    empty = RawChunk(labels=np.empty(0, np.float32), dense=np.empty((0, 0), np.float32),
                     ids=np.empty((0, len(AVAZU_TABLES)), np.uint64))  # fmt: skip
    if not rejected:
        return Block(chunk=empty, lines=0, error=(0, str(exc)))
    want = len(AVAZU_COLUMNS)
    for i, line in enumerate(block.split(b"\n")):  # the error path only: find the rejected line
        text = line.rstrip(b"\r").decode("utf-8", errors="replace")
        if text == rejected[0]:
            got = text.count(",") + 1
            return Block(chunk=empty, lines=i, error=(i, f"expected {want} fields, got {got}: {text[:120]!r}"))
    return Block(chunk=empty, lines=0, error=(0, str(exc)))


@dataclass(frozen=True, kw_only=True)
class RawFormat:
    """What a raw format looks like on disk and how one block of its lines is parsed."""

    name: str
    columns: tuple[str, ...]
    delimiter: str
    header: bool  # files normally start with a header line (one may be missing: see RawReader)
    label: str  # the label column, which tells a data line from a header
    num_dense: int
    tables: tuple[str, ...]
    direct_tables: tuple[int, ...]  # tables whose value ids are small integers (hash mode)
    parse: Callable[[bytes, bool], Block] = field(repr=False)


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


def source_files(spec: DataSpec) -> list[Path]:
    """The files of a raw spec (`common.data.files`: a file, a folder's visible files, a
    glob pattern, or a list of those). ConfigError if there is nothing to read."""
    if spec.path is None:
        raise ConfigError("data.path", f"is required for format {spec.format!r}")
    return expand(spec.path, lambda p: True, "data files")


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Whole lines of one file: bytes ``[start, stop)`` (a .gz file is one piece, whole)."""

    path: Path
    index: int  # in its file
    start: int
    stop: int

    @property
    def compressed(self) -> bool:
        return self.path.suffix == ".gz"


def split_file(path: Path, piece_bytes: int) -> list[Piece]:
    """`path` in pieces of about `piece_bytes`, each cut just after a newline."""
    size = path.stat().st_size
    if path.suffix == ".gz" or size <= piece_bytes:
        return [Piece(path=path, index=0, start=0, stop=size)]
    cuts = [0]
    with path.open("rb") as f:
        while (nominal := cuts[-1] + piece_bytes) < size:
            cut = _line_end(f, nominal - 1)
            if cut >= size:
                break
            cuts.append(cut)
    cuts.append(size)
    return [Piece(path=path, index=i, start=a, stop=b) for i, (a, b) in enumerate(pairwise(cuts))]


def _line_end(f: BinaryIO, offset: int) -> int:
    """The offset just after the first newline at or after `offset` (the file's size if none)."""
    f.seek(offset)
    while block := f.read(1 << 16):
        at = block.find(b"\n")
        if at >= 0:
            return offset + at + 1
        offset += len(block)
    return offset


def _blocks(piece: Piece, on_bytes: Callable[[int], None]) -> Iterator[bytes]:
    """The piece's bytes (decompressed) in blocks of whole lines (the last line of the file
    may lack its newline). `on_bytes` is told of the file bytes read (compressed, for .gz)."""
    with piece.path.open("rb") as raw:
        raw.seek(piece.start)
        stream: BinaryIO = gzip.GzipFile(fileobj=raw) if piece.compressed else raw  # type: ignore[assignment]
        left, done, carry = piece.stop - piece.start, piece.start, b""
        while True:
            data = stream.read(BLOCK_BYTES if piece.compressed else min(BLOCK_BYTES, left))
            left -= len(data)
            on_bytes(raw.tell() - done)
            done = raw.tell()
            if not data:
                if carry:
                    yield carry
                return
            block = carry + data if carry else data
            cut = block.rfind(b"\n") + 1
            carry = block[cut:]
            if cut:
                yield block[:cut]


def lines_before(piece: Piece) -> int:
    """Lines of the piece's file before it (the error path: numbering a line of a piece)."""
    count = 0
    with piece.path.open("rb") as f:
        left = piece.start
        while left > 0 and (block := f.read(min(BLOCK_BYTES, left))):
            count += block.count(b"\n")
            left -= len(block)
    return count


def count_lines(piece: Piece, header: int) -> int:
    """The data lines of a piece (header lines not counted): its rows, unless some are bad."""
    lines = 0
    for block in _blocks(piece, lambda n: None):
        lines += block.count(b"\n") + (not block.endswith(b"\n"))
    return lines - (header if piece.index == 0 else 0)


class PieceReader:
    """The rows of one piece, as `RawChunk`s; afterwards `rows`, `lines` and `skipped` say
    what it held. A bad line raises MalformedData naming its file and line (fail mode)."""

    def __init__(self, fmt: RawFormat, piece: Piece, *, on_error: str, header: int,
                 on_bytes: Callable[[int], None] = lambda n: None) -> None:  # fmt: skip
        self.fmt, self.piece, self.on_error, self.on_bytes = fmt, piece, on_error, on_bytes
        self.header = header if piece.index == 0 else 0
        self.rows = self.lines = self.skipped = 0

    def chunks(self) -> Iterator[RawChunk]:
        skip = self.on_error == "skip"
        blocks = _blocks(self.piece, self.on_bytes)
        for block in blocks:
            if self.lines < self.header:  # the header is the first line of piece 0
                block = block[block.find(b"\n") + 1 :] if b"\n" in block else b""
                self.lines = self.header
            parsed = self.fmt.parse(block, skip)
            if parsed.error is not None:
                blocks.close()
                line, why = parsed.error
                raise MalformedData(self.piece.path, lines_before(self.piece) + self.lines + line + 1, why)
            self.lines += parsed.lines
            self.skipped += parsed.skipped
            self.rows += len(parsed.chunk)
            if len(parsed.chunk):
                yield parsed.chunk


def check_not_empty(path: Path) -> None:
    """MalformedData for an empty file (a day file with nothing in it is a mistake)."""
    if path.stat().st_size == 0:
        raise MalformedData(path, None, "is empty: no lines to read")


def header_lines(fmt: RawFormat, path: Path) -> int:
    """Header lines to skip: 1 when the file starts with the format's header, 0 when a
    header-format file starts with a data line instead (split files made from Avazu's
    train.csv often have none). Anything else is refused, saying what line 1 holds."""
    if not fmt.header:
        return 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace", newline="") as f:  # type: ignore[operator]
        first = f.readline().rstrip("\r\n")
    fields = first.split(fmt.delimiter)
    if fields == list(fmt.columns):
        return 1
    label = fmt.columns.index(fmt.label)
    if len(fields) == len(fmt.columns) and fields[label] in ("0", "1"):
        log.warning("%s has no header line: read as headerless (line 1 is data)", path)
        return 0
    if fields == [c for c in fmt.columns if c != fmt.label]:
        why = f"this is the header of an unlabelled test file (no {fmt.label} column): nothing to train on"
    else:
        why = f"header is not the {fmt.name} header, nor is line 1 a data line"
    raise MalformedData(path, 1, f"{why}: {first[:200]!r}")


class RawReader(Reader):
    """Every row of a raw spec's files, in file order, read in one process (a `Reader`;
    conversion reads the pieces side by side instead)."""

    def __init__(self, spec: DataSpec, *, on_bytes: Callable[[int], None] = lambda n: None) -> None:
        if not spec.is_raw or spec.path is None:
            raise ConfigError("data.format", f"{spec.format!r} is not a raw format")
        super().__init__(on_error=spec.on_error, on_bytes=on_bytes)
        self.spec, self.fmt = spec, raw_format(spec)
        self.files = source_files(spec)
        self.num_dense, self.tables, self.direct_tables = self.fmt.num_dense, self.fmt.tables, self.fmt.direct_tables

    def chunks(self) -> Iterator[RawChunk]:
        for path in self.files:
            check_not_empty(path)
            header = header_lines(self.fmt, path)
            for piece in split_file(path, PIECE_BYTES):
                reader = PieceReader(self.fmt, piece, on_error=self.on_error, header=header, on_bytes=self.on_bytes)
                yield from reader.chunks()
                self.rows += reader.rows
                self.skipped += reader.skipped
        if self.skipped:
            log.warning("skipped %d malformed line(s) in %s", self.skipped, self.spec.path)


@dataclass(frozen=True, kw_only=True)
class BadLine:
    """A malformed line of a file: its number (1-based), what is wrong, and its text."""

    line: int
    why: str
    text: str


def bad_lines(spec: DataSpec, path: Path) -> list[BadLine]:
    """Every malformed line of one raw file, as the parser in fail mode judges them: each
    block is parsed until its next bad line, then on from the line after it, so a file
    costs one pass plus one block's parse per bad line (the error path, for a stream's
    quarantine: `common.data.live`)."""
    fmt = raw_format(spec)
    header = header_lines(fmt, path)
    found: list[BadLine] = []
    lines = 0
    for block in _blocks(Piece(path=path, index=0, start=0, stop=path.stat().st_size), lambda n: None):
        if lines < header:
            block = block[block.find(b"\n") + 1 :] if b"\n" in block else b""
            lines = header
        while block:
            parsed = fmt.parse(block, False)
            if parsed.error is None:
                lines += parsed.lines
                break
            at, why = parsed.error
            start = _nth_line_start(block, at)
            end = block.find(b"\n", start)
            end = len(block) if end < 0 else end + 1
            found.append(BadLine(line=lines + at + 1, why=why,
                                 text=block[start:end].rstrip(b"\r\n").decode("utf-8", errors="replace")))
            lines += at + 1
            block = block[end:]
    return found


def _nth_line_start(block: bytes, n: int) -> int:
    """The offset where line n (0-based) of `block` starts."""
    if n == 0:
        return 0
    newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
    return int(newlines[n - 1]) + 1
