"""Merging the directives of key partitions (oracle/parts.py `merge`): sorted runs, one per
partition, merged into the directive's canonical order."""

from __future__ import annotations

import numpy as np

from oracle.kernels.cache import kernel


@kernel
def merge_runs(minor: np.ndarray, keys: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The order of the rows of P concatenated lists that merges them group by group.

    `bounds` int64 [P, G + 1]: list p's rows of group g are [bounds[p, g], bounds[p, g + 1])
    of the concatenation, ascending by (minor, key). The result lists group 0's rows of
    every list, merged by (minor, key), then group 1's, ...; the keys of the lists are
    disjoint (each partition has its own), so the merge has no ties.
    """
    parts, groups = bounds.shape[0], bounds.shape[1] - 1
    order = np.empty(keys.shape[0], np.int64)
    head = np.empty(parts, np.int64)
    w = 0
    for g in range(groups):
        for p in range(parts):
            head[p] = bounds[p, g]
        while True:
            best = -1
            row = -1
            for p in range(parts):
                r = head[p]
                if r >= bounds[p, g + 1]:
                    continue
                if best < 0 or minor[r] < minor[row] or (minor[r] == minor[row] and keys[r] < keys[row]):
                    best, row = p, r
            if best < 0:
                break
            order[w] = row
            w += 1
            head[best] += 1
    return order
