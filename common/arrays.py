"""Array helpers the oracle, the trainers and the PS share."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

_HUGE_PAGE = 1 << 21


def lazy_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros that cost only the pages written to: anonymous memory with transparent huge
    pages off. ``np.zeros`` maps untouched memory lazily too, but where the kernel's THP mode
    is ``always`` (common) each first write to a 2 MB region makes all of it resident: a
    shard's table became resident whole after a few thousand random rows (276.6 MB above a
    fresh store at 4,096 rows against 15.9 MB with huge pages off: bench/scale.py)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype=dtype).reshape(shape)


#: Up to this many values, `bounds` reads them in Python: each numpy reduction has a fixed
#: cost of about 1 us, more than min() and max() of a short list (a small PS fetch is 4 keys).
FEW = 32


def in_sorted(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """`np.isin(values, pool)` for an ascending `pool`, by binary search: no hashing, no sort."""
    return _search_sorted(values, pool)[1]


def find_sorted(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Each value's index in an ascending `pool` of distinct values, or -1 where it is absent."""
    at, found = _search_sorted(values, pool)
    return np.where(found, at, -1)


def _search_sorted(values: np.ndarray, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each value would go in an ascending `pool`, and whether it is there."""
    at = np.searchsorted(pool, values)
    found = at < pool.size
    found[found] = pool[at[found]] == values[found]
    return at, found


def has_duplicates(values: np.ndarray) -> bool:
    """Whether some value occurs twice: by sorting (see `sorted_unique`)."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)``: the distinct values of any shape's elements, ascending. By one
    sort: numpy 2's `np.unique` hashes integers and then sorts what it found, 4 to 9 times
    slower for 6,400 to 26,624 keys (2 to 2.5 times where a few keys repeat a lot). Its
    `return_inverse` and `return_counts` forms sort, and are not slower."""
    ordered = np.sort(values, axis=None)
    if ordered.size < 2:
        return ordered
    first = np.empty(ordered.size, bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


def rows_where(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values[mask]`` along the first axis: `values` itself where the mask is all True (no
    copy), else by np.compress, the same copy three times faster than boolean indexing for
    rows of a few dozen values."""
    return values if mask.all() else np.compress(mask, values, axis=0)


def bounds(values: np.ndarray) -> tuple[Any, Any] | None:
    """(min, max) of a numeric array of any shape, as Python numbers; None if it is empty."""
    if values.size <= FEW:
        items = values.reshape(-1).tolist()
        return (min(items), max(items)) if items else None
    return values.min().item(), values.max().item()
