"""What every source reader yields, and the one rule for rows that break a check.

Raw text logs, TorchRec npy days and parquet files are all read into `RawChunk`s of
categorical *value ids*; `common.data.convert` maps those to rows. A reader describes each
rule a column must follow as a `Check` (a bad-row mask) and hands them to `screen`: with
``on_error="fail"`` the first bad row raises `MalformedData` naming the file and the line or
row, with ``"skip"`` bad rows are dropped and counted. Whole-file problems (a missing file or
column, a wrong dtype or shape, row counts that disagree) always raise.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from common.data.hashing import MISSING
from common.errors import BagpipeError


class MalformedData(BagpipeError):
    """Source data that cannot be used: names the file and, where one is at fault, the
    1-based line (text files) or the 0-based row (array and parquet files)."""

    code = "bad_data"

    def __init__(self, path: Path, line: int | None, message: str, *, row: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}: row {row}" if row is not None else str(path)
        super().__init__(f"{where}: {message}", file=str(path), line=line, row=row)
        self.path, self.line, self.row, self.why = path, line, row, message


@dataclass(frozen=True, kw_only=True)
class RawChunk:
    """Rows of one block: labels float32 [n], dense float32 [n, D], ids uint64 [n, F]
    (`hashing.MISSING` where a value is missing)."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, keep: np.ndarray) -> RawChunk:
        return RawChunk(labels=self.labels[keep], dense=self.dense[keep], ids=self.ids[keep])


@dataclass(frozen=True, kw_only=True)
class Check:
    """Rows of one column that break one rule; `values` (that column, numpy or arrow) is
    only read to quote the first bad value in an error."""

    column: str
    mask: np.ndarray
    values: np.ndarray | pa.Array
    rule: str = ""

    def describe(self, i: int) -> str:
        value = self.values[i]
        value = value.as_py() if isinstance(value, pa.Scalar) else value.item()
        rule = f" ({self.rule})" if self.rule else ""
        return f"bad {self.column} value{': missing' if value is None else f' {value!r}'}{rule}"


def column_checks(
    names: Sequence[str], bad: np.ndarray, columns: Sequence[np.ndarray | pa.Array], rule: str | Sequence[str]
) -> list[Check]:
    """One `Check` per column of a ``[n, K]`` mask that has a bad row (none in the usual,
    clean case, so screening costs one pass over the mask). `columns[j]` and `rule[j]` (or
    `rule`) describe column j in an error."""
    if not bad.any():
        return []
    rules = [rule] * len(names) if isinstance(rule, str) else rule
    return [Check(column=names[j], mask=bad[:, j], values=columns[j], rule=rules[j])
            for j in np.flatnonzero(bad.any(axis=0))]  # fmt: skip


def label_values(
    column: str, values: np.ndarray, missing: np.ndarray | None, shown: np.ndarray | pa.Array
) -> tuple[np.ndarray, Check]:
    """float32 labels of a numeric column and the rule they follow: 0 or 1, present (a NaN
    fails it too, since it equals neither)."""
    bad = (values != 0) & (values != 1)
    if missing is not None:
        bad |= missing
    return values.astype(np.float32), Check(column=column, mask=bad, values=shown, rule="must be 0 or 1")


def id_values(
    names: Sequence[str], ids: np.ndarray, missing: np.ndarray, shown: Sequence[np.ndarray | pa.Array],
    sizes: tuple[int, ...] | None,
) -> tuple[np.ndarray, list[Check]]:
    """Value ids (uint64 [n, K], `MISSING` where `missing`) of integer ids (int64 [n, K]) and
    the rules they follow: none negative (a uint64 id past 2**63, cast, shows as negative)
    and, when the ids are rows already (`sizes` given, hashing = "none"), each below its
    table's size."""
    checks = column_checks(names, ids < 0, shown, "ids must be >= 0 and below 2**63")
    if sizes is not None:
        over = ids >= np.asarray(sizes, dtype=np.int64)
        checks += column_checks(names, over, shown, [f"must be below {n}, its table's size" for n in sizes])
    out = ids.astype(np.uint64)
    out[missing] = MISSING
    return out, checks


def screen(
    chunk: RawChunk, checks: list[Check], *, on_error: str, error_at: Callable[[int, Check], MalformedData]
) -> tuple[RawChunk, int]:
    """(`chunk` without its bad rows, how many were dropped). In fail mode the first bad row
    raises ``error_at(row index in chunk, the first check it breaks)`` instead."""
    bad = np.zeros(len(chunk), dtype=bool)
    for check in checks:
        bad |= check.mask
    if not bad.any():
        return chunk, 0
    if on_error == "fail":
        i = int(np.argmax(bad))
        raise error_at(i, next(c for c in checks if c.mask[i]))
    return chunk.select(~bad), int(bad.sum())


def row_errors(start: int, file_of: Callable[[str], Path]) -> Callable[[int, Check], MalformedData]:
    """`screen`'s error_at for rows numbered from `start` (0-based, in the file), naming the
    file that holds the bad column."""
    return lambda i, check: MalformedData(file_of(check.column), None, check.describe(i), row=start + i)


def bytes_done(size: int, rows_done: int, rows: int) -> int:
    """Progress, in bytes of a `size`-byte file, once `rows_done` of its `rows` are read
    (binary formats are read by row, not by byte)."""
    return size * rows_done // rows if rows else size


class Reader(abc.ABC):
    """A source's rows in a fixed order, as `RawChunk`s. After a full pass of `chunks`,
    `rows` is the rows delivered and `skipped` the bad ones dropped (skip mode). `on_bytes`
    is told of the bytes read as they are (progress)."""

    files: list[Path]
    num_dense: int
    tables: tuple[str, ...]  # one name per table
    direct_tables: tuple[int, ...] = ()  # tables whose value ids are small integers (hash mode)

    def __init__(self, *, on_error: str, on_bytes: Callable[[int], None]) -> None:
        self.on_error = on_error
        self.on_bytes = on_bytes
        self.rows = 0
        self.skipped = 0

    @abc.abstractmethod
    def chunks(self) -> Iterator[RawChunk]: ...

    def keep(self, chunk: RawChunk, checks: list[Check], error_at: Callable[[int, Check], MalformedData]) -> RawChunk:
        """`screen` the chunk and count what is delivered and dropped."""
        chunk, dropped = screen(chunk, checks, on_error=self.on_error, error_at=error_at)
        self.skipped += dropped
        self.rows += len(chunk)
        return chunk
