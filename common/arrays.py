"""Array helpers the oracle and the trainers share."""

from __future__ import annotations

import numpy as np


def in_sorted(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """`np.isin(values, pool)` for an ascending `pool`, by binary search: no hashing, no sort."""
    at = np.searchsorted(pool, values)
    found = at < pool.size
    found[found] = pool[at[found]] == values[found]
    return found
