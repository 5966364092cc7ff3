"""Array helpers the oracle, the trainers and the PS share."""

from __future__ import annotations

import numpy as np


def in_sorted(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """`np.isin(values, pool)` for an ascending `pool`, by binary search: no hashing, no sort."""
    at = np.searchsorted(pool, values)
    found = at < pool.size
    found[found] = pool[at[found]] == values[found]
    return found


def has_duplicates(values: np.ndarray) -> bool:
    """Whether some value occurs twice: by sorting, several times faster than `np.unique`,
    which hashes integers in numpy 2."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())
