"""The hash map from keys to int64 values that the planner's index and the reading of a
batch use (`IntMap`): open addressing with linear probing, no deletion.

The planner's index (`BagpipeState.index`) maps every key read and not yet planned to its
last use to its entry, and keeps a key whose entry is gone, with the version of its last
write-back, until no fetch can need it: one lookup when a key comes and one when it goes.
When the index must grow it forgets the versions that every fetch from then on would ask
for as -1 (`reserve_index`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from oracle.kernels.cache import inlined, kernel

# IntMap.cells, int64 [cap, 2]: a key and its value side by side, one cache line a probe.
CELL_KEY = 0  # -1: empty
CELL_VALUE = 1
# BagpipeState.index values: an entry (>= 0), or, for a key without one, -2 - the version of
# its last write-back (so -1: never written back).


class IntMap(NamedTuple):
    """Hash map from non-negative int64 keys to int64 values, in one array: open addressing
    with linear probing, no deletion. Keep it at most half full (`reserve_index`)."""

    cells: np.ndarray  # int64 [cap, 2]: CELL_*; cap a power of two
    size: np.ndarray  # int64 [1]: keys held


KEEP_ALL = -2  # `rehashed` forgets no version: none is older than -1

# Fibonacci hashing: the golden ratio times the key spreads runs of keys over the table.
_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as an int64


def new_map(capacity: int) -> IntMap:
    """An empty map with room for `capacity` // 2 keys (`capacity` a power of two)."""
    cells = np.empty((capacity, 2), np.int64)
    cells[:, CELL_KEY] = -1
    return IntMap(cells=cells, size=np.zeros(1, np.int64))


def reserve_index(m: IntMap, more: int, forget_through: int) -> IntMap:
    """The planner's index `m`, or a copy of it, with room for `more` further keys. A copy
    leaves out the keys that only hold a write-back version <= `forget_through` (no fetch
    will ask for it: `PlannerConfig.landed_through`), and is larger than `m` only where what
    it keeps would fill more than a quarter of it: so the index grows with the keys in the
    window and the versions still needed, not with the keys of the run."""
    capacity = m.cells.shape[0]
    if 2 * (int(m.size[0]) + more) <= capacity:
        return m
    kept = index_kept(m.cells, forget_through)
    while capacity < 4 * (kept + more):
        capacity *= 2
    cells = rehashed(m.cells, capacity, forget_through)
    return IntMap(cells=cells, size=np.array([kept], np.int64))


@inlined
def _forgotten(value: int, forget_through: int) -> bool:
    """Whether an index cell's value is a write-back version <= forget_through."""
    return value < 0 and -2 - value <= forget_through


@kernel
def index_kept(cells: np.ndarray, forget_through: int) -> int:
    kept = 0
    for i in range(cells.shape[0]):
        if cells[i, CELL_KEY] >= 0 and not _forgotten(cells[i, CELL_VALUE], forget_through):
            kept += 1
    return kept


@kernel
def rehashed(cells: np.ndarray, capacity: int, forget_through: int) -> np.ndarray:
    """The keys and values of map cells, in new cells of `capacity` (a power of two), less
    the planner index's versions <= `forget_through` (`KEEP_ALL`: none)."""
    out = np.empty((capacity, 2), np.int64)
    for i in range(capacity):
        out[i, CELL_KEY] = -1
    for i in range(cells.shape[0]):
        if cells[i, CELL_KEY] >= 0 and not _forgotten(cells[i, CELL_VALUE], forget_through):
            c = map_find(out, cells[i, CELL_KEY])
            out[c, CELL_KEY] = cells[i, CELL_KEY]
            out[c, CELL_VALUE] = cells[i, CELL_VALUE]
    return out


@inlined
def map_home(cells: np.ndarray, key: int) -> int:
    """The cell where the probe for `key` starts (to prefetch it)."""
    h = key * _MIX
    return (h ^ (h >> 32)) & (cells.shape[0] - 1)


@inlined
def map_find(cells: np.ndarray, key: int) -> int:
    """The cell of `key` in a map's cells, or the empty cell where it would go."""
    mask = cells.shape[0] - 1
    i = map_home(cells, key)
    while cells[i, CELL_KEY] != key and cells[i, CELL_KEY] >= 0:
        i = (i + 1) & mask
    return i
