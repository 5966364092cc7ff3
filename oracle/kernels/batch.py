"""Reading a global batch into its sorted distinct (key, trainer) pairs (`read_pairs`), which
every mode's rules plan from: a hash table per trainer, then a radix sort. A planner of one
key partition reads only its keys' inputs (`read_partition_pairs`, `key_partition`)."""

from __future__ import annotations

import numpy as np

from oracle.kernels.intmap import CELL_KEY, CELL_VALUE, KEEP_ALL, map_find, rehashed
from oracle.kernels.cache import inlined, kernel

# SplitMix64's finaliser (Steele, Lea and Flood 2014): every bit of a key moves every bit of
# the hash, so keys that are table offsets plus rows spread evenly over any partition count,
# and not in step with the index's Fibonacci hashing (intmap).
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_U30, _U27, _U31, _U32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)


@kernel
def read_pairs(keys: np.ndarray, num_trainers: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (key, trainer) pairs of a global batch int64 [B, F], ascending (pair id
    key * T + trainer, sample i on trainer i // (B/T)), and the index of every input's pair
    (int32 [B * F]). Hashing, then sorting the distinct pairs only: np.unique would sort every
    input, and a batch has several inputs per pair."""
    number, pair_of = _number_pairs(keys, num_trainers)
    order = _radix_order(pair_of)
    rank = np.empty(order.size, np.int32)
    for r in range(order.size):
        rank[order[r]] = r
    inverse = np.empty(number.size, np.int32)
    for i in range(number.size):
        inverse[i] = rank[number[i]]
    return pair_of[order], inverse


@inlined
def key_partition(key: int, count: int) -> int:
    """The partition (0 .. count-1) of a non-negative key: the top 32 bits of its hash,
    scaled to the count (Lemire's multiply-shift, no division)."""
    z = np.uint64(key) + _GAMMA
    z = (z ^ (z >> _U30)) * _MIX1
    z = (z ^ (z >> _U27)) * _MIX2
    z = z ^ (z >> _U31)
    return np.int64(((z >> _U32) * np.uint64(count)) >> _U32)


@kernel
def key_partitions(keys: np.ndarray, count: int) -> np.ndarray:
    """`key_partition` of every key of a flat int64 array (int32)."""
    out = np.empty(keys.shape[0], np.int32)
    for i in range(keys.shape[0]):
        out[i] = key_partition(keys[i], count)
    return out


@kernel
def read_partition_pairs(
    keys: np.ndarray, num_trainers: int, part: int, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`read_pairs` of the inputs whose key is in partition `part` of `count`: their pairs,
    the pair of each such input (int32) and its flat position in the batch (int32)."""
    number, pair_of, positions = _number_pairs_of(keys, num_trainers, part, count)
    order = _radix_order(pair_of)
    rank = np.empty(order.size, np.int32)
    for r in range(order.size):
        rank[order[r]] = r
    inverse = np.empty(number.size, np.int32)
    for i in range(number.size):
        inverse[i] = rank[number[i]]
    return pair_of[order], inverse, positions


@kernel
def _number_pairs(keys: np.ndarray, num_trainers: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch's pairs numbered in order of first appearance: the number of every input
    (flat), and the pair of every number. One table per trainer, since trainers share no
    pair: a smaller table stays in cache."""
    b, f = keys.shape
    per = b // num_trainers
    number = np.empty(b * f, np.int32)
    pair_of = np.empty(b * f, np.int64)
    n = 0
    for j in range(num_trainers):
        cells = rehashed(np.empty((0, 2), np.int64), 1 << 12, KEEP_ALL)  # empty; grows with the pairs
        held = 0
        for i in range(j * per, (j + 1) * per):
            for c in range(f):
                p = keys[i, c] * num_trainers + j
                cell = map_find(cells, p)
                if cells[cell, CELL_KEY] < 0:
                    if 2 * (held + 1) > cells.shape[0]:
                        cells = rehashed(cells, 2 * cells.shape[0], KEEP_ALL)
                        cell = map_find(cells, p)
                    cells[cell, CELL_KEY] = p
                    cells[cell, CELL_VALUE] = n
                    pair_of[n] = p
                    n += 1
                    held += 1
                number[i * f + c] = cells[cell, CELL_VALUE]
    return number, pair_of[:n]


@kernel
def _radix_order(values: np.ndarray) -> np.ndarray:
    """The order that sorts non-negative `values`: LSD radix sort, 11 bits a pass (about
    five times np.argsort's speed on a batch's pairs)."""
    n = values.size
    order = np.arange(n)
    spare = np.empty(n, np.int64)
    top = values.max() if n else 0
    shift = 0
    while shift < 63 and (shift == 0 or top >> shift > 0):
        starts = np.zeros(2049, np.int64)
        for i in range(n):
            starts[((values[i] >> shift) & 2047) + 1] += 1
        for d in range(2048):
            starts[d + 1] += starts[d]
        for i in range(n):
            o = order[i]
            d = (values[o] >> shift) & 2047
            spare[starts[d]] = o
            starts[d] += 1
        order, spare = spare, order
        shift += 11
    return order


@kernel
def _number_pairs_of(
    keys: np.ndarray, num_trainers: int, part: int, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_number_pairs` of the inputs whose key is in partition `part` of `count`, and where
    each such input is. The inputs of the partition are listed first, without a branch (an
    input is in it with probability 1 / count: a test per input would be mispredicted about
    every other time at P = 2, which cost as much as the lookups it saved)."""
    b, f = keys.shape
    per = b // num_trainers
    flat = keys.reshape(-1)
    positions = np.empty(b * f, np.int32)  # input i is written at kept <= i
    ends = np.empty(num_trainers, np.int64)  # trainer j's inputs: positions[ends[j-1]:ends[j]]
    kept = 0
    for j in range(num_trainers):
        for i in range(j * per * f, (j + 1) * per * f):
            positions[kept] = i
            kept += key_partition(flat[i], count) == part
        ends[j] = kept
    number = np.empty(kept, np.int32)
    pair_of = np.empty(kept, np.int64)
    n = 0
    start = 0
    for j in range(num_trainers):
        cells = rehashed(np.empty((0, 2), np.int64), 1 << 12, KEEP_ALL)
        held = 0
        for q in range(start, ends[j]):  # `_number_pairs`'s numbering, written out again: an
            # inlined helper returning the table it may grow made both half again as slow
            # (numba's reference counting of arrays taken out of tuples: kernels/__init__.py)
            p = flat[positions[q]] * num_trainers + j
            cell = map_find(cells, p)
            if cells[cell, CELL_KEY] < 0:
                if 2 * (held + 1) > cells.shape[0]:
                    cells = rehashed(cells, 2 * cells.shape[0], KEEP_ALL)
                    cell = map_find(cells, p)
                cells[cell, CELL_KEY] = p
                cells[cell, CELL_VALUE] = n
                pair_of[n] = p
                n += 1
                held += 1
            number[q] = cells[cell, CELL_VALUE]
        start = ends[j]
    return number, pair_of[:n], positions[:kept]
