"""Categorical value ids → embedding rows, by stable hash or by a frequency dictionary.

Both schemes keep row 0 of every table for a missing value. Hashing sends a present value
to ``1 + mix64(id ^ salt_t) % (n_t - 1)``. A dictionary gives row 1 to every value seen
fewer than `min_frequency` times (or crowded out by the table's cap) and rows 2, 3, ... to
the others, most frequent first, ties broken by value, so the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.hashing import MISSING, direct_rows, hash_rows, hash_salt
from common.data.chunks import RawChunk

MISSING_ROW = 0
RARE_ROW = 1


@dataclass(frozen=True, kw_only=True)
class Vocabulary:
    """One table's dictionary: `values` (sorted uint64 ids) own `rows` (int64, >= 2)."""

    values: np.ndarray
    rows: np.ndarray

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        pos = np.minimum(np.searchsorted(self.values, ids), max(len(self.values) - 1, 0))
        found = self.values[pos] == ids if len(self.values) else np.zeros(len(ids), dtype=bool)
        rows = np.where(found, self.rows[pos].astype(np.int64) if len(self.rows) else 0, RARE_ROW)
        rows[ids == MISSING] = MISSING_ROW
        return rows.astype(np.int64)


class Counter:
    """Exact per-value counts of one table. Ids are buffered and merged into the sorted
    counts a million or so at a time: merging costs the distinct values so far, so merging
    every small chunk would cost their square."""

    FLUSH = 1 << 20

    def __init__(self) -> None:
        self.values = np.empty(0, dtype=np.uint64)
        self.counts = np.empty(0, dtype=np.int64)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: np.ndarray) -> None:
        present = ids[ids != MISSING]
        self._buffer.append(present)
        self._buffered += len(present)
        if self._buffered >= self.FLUSH:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            u, c = np.unique(np.concatenate(self._buffer), return_counts=True)
            self._buffer, self._buffered = [], 0
            self.merge(u, c)

    def merge(self, values: np.ndarray, counts: np.ndarray) -> None:
        """Add sorted distinct `values` seen `counts` times."""
        merged, inverse = np.unique(np.concatenate([self.values, values]), return_inverse=True)
        weights = np.concatenate([self.counts, counts]).astype(np.float64)
        self.values = merged
        self.counts = np.bincount(inverse, weights=weights, minlength=len(merged)).astype(np.int64)

    def vocabulary(self, min_frequency: int, cap: int | None) -> Vocabulary:
        self.flush()
        keep = self.counts >= min_frequency
        values, counts = self.values[keep], self.counts[keep]
        order = np.lexsort((values, -counts))  # most frequent first, then by value
        if cap is not None:
            order = order[: max(cap - 2, 0)]
        chosen = values[order]
        rows = np.arange(2, 2 + len(chosen), dtype=np.int64)
        by_value = np.argsort(chosen)
        return Vocabulary(values=chosen[by_value], rows=rows[by_value])


def build_vocabularies(
    chunks: Iterable[RawChunk], num_tables: int, min_frequency: int, caps: tuple[int, ...]
) -> list[Vocabulary]:
    """Count every table's values over `chunks` (one full pass) and build the dictionaries.

    `caps` (empty = no cap) bounds each table's size, rows 0 and 1 included.
    """
    counters = [Counter() for _ in range(num_tables)]
    for chunk in chunks:
        for t, counter in enumerate(counters):
            counter.add(chunk.ids[:, t])
    return [c.vocabulary(min_frequency, caps[t] if caps else None) for t, c in enumerate(counters)]


@dataclass(frozen=True, kw_only=True)
class RowMapper:
    """Maps a chunk's ``[n, F]`` value ids to ``[n, F]`` int64 rows in ``[0, sizes[t])``."""

    sizes: tuple[int, ...]
    direct_tables: tuple[int, ...] = ()
    vocabularies: tuple[Vocabulary, ...] | None = None  # None: hash mode
    ids_are_rows: bool = False  # hashing = "none": the reader has checked ids against sizes

    @classmethod
    def for_dictionary(cls, vocabularies: list[Vocabulary], caps: tuple[int, ...]) -> RowMapper:
        """Sizes are the caps when given (so the model matches the spec), else 2 + vocab."""
        sizes = caps or tuple(2 + len(v.values) for v in vocabularies)
        return cls(sizes=sizes, vocabularies=tuple(vocabularies))

    @classmethod
    def load_dictionary(cls, folder: Path, num_tables: int, caps: tuple[int, ...]) -> RowMapper:
        """The dictionaries `save` wrote into `folder`, memory-mapped (shared by every
        worker that reads them, never copied)."""
        vocabs = []
        for t in range(num_tables):
            stacked = np.load(folder / vocabulary_file(t), mmap_mode="r")
            vocabs.append(Vocabulary(values=stacked[0], rows=stacked[1]))
        return cls.for_dictionary(vocabs, caps)

    def rows_as(self, ids: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """`rows` as `dtype`; hashed tables through the compiled kernel (the same bits,
        `common.data.kernels.hash_into`: conversion only, since it imports numba)."""
        if self.ids_are_rows or self.vocabularies is not None or self.direct_tables:
            return self.rows(ids).astype(dtype, copy=False)
        from common.data import kernels

        salts = np.array([hash_salt(t) for t in range(len(self.sizes))], dtype=np.uint64)
        moduli = np.array([max(n - 1, 0) for n in self.sizes], dtype=np.uint64)
        out = np.empty(ids.shape, dtype=dtype)
        kernels.hash_into(np.ascontiguousarray(ids, dtype=np.uint64), salts, moduli, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        if self.ids_are_rows:
            return np.where(ids == MISSING, MISSING_ROW, ids).astype(np.int64)
        out = np.empty(ids.shape, dtype=np.int64)
        for t, size in enumerate(self.sizes):
            if self.vocabularies is not None:
                out[:, t] = self.vocabularies[t].lookup(ids[:, t])
            elif t in self.direct_tables:
                out[:, t] = direct_rows(ids[:, t], size)
            else:
                out[:, t] = hash_rows(ids[:, t], t, size)
        return out

    def save(self, folder: Path) -> list[str]:
        """Write the dictionaries (if any) as .npy files into `folder`; returns their names."""
        return [save_vocabulary(folder, t, vocab) for t, vocab in enumerate(self.vocabularies or ())]


def vocabulary_file(table: int) -> str:
    return f"vocab_{table}.npy"


def save_vocabulary(folder: Path, table: int, vocab: Vocabulary) -> str:
    """Write one table's dictionary into `folder` (values and rows, uint64 [2, n]); its name."""
    name = vocabulary_file(table)
    np.save(folder / name, np.stack([vocab.values, vocab.rows.astype(np.uint64)]))
    return name
