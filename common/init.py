"""The initial value of every embedding row as a pure function of (seed, key)
(docs/design.md#keys-sharding-and-initial-values).

Each element is drawn from a counter-based generator (SplitMix64 over the element's index
``key * dim + column`` mixed with the seed), scaled to ``±sqrt(1 / n_t)`` as DLRM does. Any
process (a PS shard initialising lazily, a reference trainer, a test) computes the same
float32 bits for a key, whatever the number of shards or the order of requests.
"""

from __future__ import annotations

import numpy as np

from common.keys import TableLayout

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def initial_rows(layout: TableLayout, seed: int, keys: np.ndarray, dim: int) -> np.ndarray:
    """``[len(keys), dim]`` float32 initial rows for global `keys`."""
    keys = np.asarray(keys, dtype=np.int64)
    with np.errstate(over="ignore"):
        counters = keys.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
        mixed = _splitmix64(counters ^ _splitmix64(np.full(1, seed, dtype=np.uint64)))
    unit = (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
    sizes = np.asarray(layout.sizes, dtype=np.float64)[layout.table_of(keys)]
    scale = np.sqrt(1.0 / sizes)[:, None]
    return ((2.0 * unit - 1.0) * scale).astype(np.float32)
