"""Entries and a key's records in the planner's store: one array of rows (`BagpipeState.pool`)
that is also seen as entries (`BagpipeState.entry`, ENTRY_ROWS rows each).

A key's records are one per trainer that holds a copy of the key or has an unplanned use of
it, ascending by trainer (cells `layout.REC_*`). Why records rather than a row of T pairs
per key: most keys are used by one trainer in a window (the cold tail), a few by all of
them, so a row of T cells per key would make memory, and every scan over a key's trainers,
grow with T for every key. A key's records cost what it has: the steps scan its records,
and a trainer without a record is one without a copy and without an unplanned use.

Up to HOME_RECORDS records sit in the entry's home, the rows right after its cells, so that
the lines an entry brings into the cache bring them too. A key with more has a block of 2 **
c rows (its size class c) elsewhere in the store. Free blocks of each class form a list
threaded through their first rows (`pool_free`; `counters[POOL_CLASSES]` has a bit for each
class that has one); a class with none splits a larger free block. Freed entries are
stacked (`entry_free`). Only when neither has one does the store hand out fresh rows
(`counters[POOL_USED]`); when none is left the caller stops (-1) and the Python side grows
the store between calls (`state.grow_store`), so a kernel never allocates state.
"""

from __future__ import annotations

import numpy as np

from common.cpu_prefetch import prefetch_line, prefetch_row
from oracle.kernels.cache import inlined
from oracle.kernels.layout import (
    ENTRY_BLOCK,
    ENTRY_CLASS,
    ENTRY_RECORDS,
    ENTRY_ROWS,
    FREED_ENTRIES,
    HOME_CLASS,
    HOME_RECORDS,
    HOME_ROW,
    NUM_REC,
    POOL_CLASSES,
    POOL_USED,
    REC_NEXT_FREE,
    REC_SLOT,
    REC_TAIL,
    REC_TRAINER,
)


@inlined
def prefetch_entry(entry: np.ndarray, pool: np.ndarray, e: int, lines: int) -> None:
    """Start loading the first `lines` cache lines of entry e: its cells (1), its home (2),
    its leavers' cells (3)."""
    for line in range(lines):
        prefetch_line(entry, e, line)


@inlined
def prefetch_block(entry: np.ndarray, pool: np.ndarray, e: int) -> None:
    """Start loading entry e's records, every line of their block, unless they are at home
    (`prefetch_entry`): once its cells are in, or this waits for them. A key that many
    trainers use has a block of many lines, which its scans would otherwise wait on line by
    line."""
    if entry[e, ENTRY_CLASS] != HOME_CLASS:
        first = entry[e, ENTRY_BLOCK]
        for r in range(first, first + entry[e, ENTRY_RECORDS], 2):  # two records a line
            prefetch_row(pool, r)


@inlined
def home_of(e: int) -> int:
    """The first pool row of entry e's home."""
    return ENTRY_ROWS * e + HOME_ROW


@inlined
def room_of(entry: np.ndarray, e: int) -> int:
    """How many records entry e's home or block holds."""
    c = entry[e, ENTRY_CLASS]
    return HOME_RECORDS if c == HOME_CLASS else 1 << c


@inlined
def take_entry(pool: np.ndarray, entry_free: np.ndarray, counters: np.ndarray) -> int:
    """A free entry, or -1 if the store has none left."""
    if counters[FREED_ENTRIES] > 0:
        counters[FREED_ENTRIES] -= 1
        return entry_free[counters[FREED_ENTRIES]]
    e = (counters[POOL_USED] + ENTRY_ROWS - 1) // ENTRY_ROWS
    if ENTRY_ROWS * (e + 1) > pool.shape[0]:
        return -1
    counters[POOL_USED] = ENTRY_ROWS * (e + 1)
    return e


@inlined
def give_entry(entry: np.ndarray, entry_free: np.ndarray, counters: np.ndarray, e: int) -> None:
    """Entry e is free; its records are at home (none)."""
    entry[e, ENTRY_BLOCK] = home_of(e)
    entry[e, ENTRY_RECORDS] = 0
    entry[e, ENTRY_CLASS] = HOME_CLASS
    entry_free[counters[FREED_ENTRIES]] = e
    counters[FREED_ENTRIES] += 1


@inlined
def block_class(records: int) -> int:
    """The size class of a block for `records` > HOME_RECORDS records."""
    c = 0
    while (1 << c) < records:
        c += 1
    return c


@inlined
def take_block(pool: np.ndarray, pool_free: np.ndarray, counters: np.ndarray, c: int) -> int:
    """A block of 2 ** c rows (its first row), or -1 if the store has none left."""
    larger = counters[POOL_CLASSES] >> c  # bit k: a free block of class c + k
    if larger & 1:
        return _pop_block(pool, pool_free, counters, c)
    if larger:  # split the smallest larger one: keep its first 2 ** c rows, free the rest
        k = c
        while not (larger & 1):
            larger >>= 1
            k += 1
        row = _pop_block(pool, pool_free, counters, k)
        for half in range(k - 1, c - 1, -1):
            give_block(pool, pool_free, counters, row + (1 << half), half)
        return row
    row = counters[POOL_USED] + (counters[POOL_USED] & 1)  # blocks start cache lines
    if row + (1 << c) > pool.shape[0]:
        return -1
    counters[POOL_USED] = row + (1 << c)
    return row


@inlined
def _pop_block(pool: np.ndarray, pool_free: np.ndarray, counters: np.ndarray, c: int) -> int:
    row = pool_free[c]
    pool_free[c] = pool[row, REC_NEXT_FREE]
    if pool_free[c] < 0:
        counters[POOL_CLASSES] &= ~(1 << c)
    return row


@inlined
def give_block(
    pool: np.ndarray, pool_free: np.ndarray, counters: np.ndarray, row: int, c: int
) -> None:
    """The block of 2 ** c rows at `row` is free."""
    pool[row, REC_NEXT_FREE] = pool_free[c]
    pool_free[c] = row
    counters[POOL_CLASSES] |= 1 << c


@inlined
def copy_record(pool: np.ndarray, src: int, dst: int) -> None:
    if src != dst:
        for cell in range(NUM_REC):
            pool[dst, cell] = pool[src, cell]


@inlined
def record_of(pool: np.ndarray, entry: np.ndarray, e: int, j: int) -> int:
    """The pool row of trainer j's record of entry e, or -1 if j has none (binary search:
    the records ascend by trainer)."""
    lo = entry[e, ENTRY_BLOCK]
    hi = lo + entry[e, ENTRY_RECORDS]
    while lo < hi:
        mid = (lo + hi) >> 1
        t = pool[mid, REC_TRAINER]
        if t < j:
            lo = mid + 1
        elif t > j:
            hi = mid
        else:
            return mid
    return -1


@inlined
def lowest_holder(pool: np.ndarray, entry: np.ndarray, e: int) -> int:
    """The pool row of the lowest-index trainer holding a copy of entry e's key, or -1."""
    first = entry[e, ENTRY_BLOCK]
    for r in range(first, first + entry[e, ENTRY_RECORDS]):
        if pool[r, REC_SLOT] >= 0:
            return r
    return -1


@inlined
def compact_records(pool: np.ndarray, entry: np.ndarray, e: int) -> int:
    """Drop entry e's records that have neither a copy nor an unplanned use (what a copy
    that left, or a use planned, leaves behind); how many remain, in trainer order. A key
    with a block keeps it while its entry lives: a key used by many trainers once is
    likely to be again."""
    first = entry[e, ENTRY_BLOCK]
    w = first
    for r in range(first, first + entry[e, ENTRY_RECORDS]):
        if pool[r, REC_SLOT] >= 0 or pool[r, REC_TAIL] >= 0:
            copy_record(pool, r, w)
            w += 1
    entry[e, ENTRY_RECORDS] = w - first
    return w - first
