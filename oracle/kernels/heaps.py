"""The heaps of each trainer's cache: the free slots (a min-heap, the smallest free slot is
handed out) and the Belady victims of iteration x (its copies not used at x, gathered only
when that trainer must evict at x, in buckets by next use, each made a heap when reached)."""

from __future__ import annotations

import numpy as np

from oracle.kernels.cache import inlined, kernel
from oracle.kernels.layout import (
    NEVER,
    NUM_VICTIM,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
    VICTIM_BUCKETS,
    VICTIM_KEY,
    VICTIM_NEXT,
    VICTIM_SLOT,
    VICTIMS_BUCKET,
    VICTIMS_BUILT_AT,
    VICTIMS_HI,
    VICTIMS_LO,
)


# --------------------------------------------------------------------------- free slots
@inlined
def push_free_slot(heap: np.ndarray, size: np.ndarray, j: int, slot: int) -> None:
    """Trainer j's `slot` is free: onto its heap."""
    i = size[j]
    size[j] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if heap[j, parent] <= slot:
            break
        heap[j, i] = heap[j, parent]
        i = parent
    heap[j, i] = slot


@inlined
def pop_free_slot(heap: np.ndarray, size: np.ndarray, j: int) -> int:
    """Trainer j's smallest free slot, taken off its heap (callers know it has one)."""
    top = heap[j, 0]
    n = size[j] - 1
    size[j] = n
    last = heap[j, n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and heap[j, child + 1] < heap[j, child]:
            child += 1
        if heap[j, child] >= last:
            break
        heap[j, i] = heap[j, child]
        i = child
    if n > 0:
        heap[j, i] = last
    return top


# --------------------------------------------------------------------------- victims
# Rule 4's order: a trainer's copies not used at x, farthest next use first (none in the
# window = NEVER), ties larger key first. An iteration takes hundreds to thousands of
# victims from a trainer's tens of thousands of copies, so they are not all made one heap:
# one pass puts them in VICTIM_BUCKETS buckets by next use, ranges of `victims` in that
# order (a counting sort), and only the buckets reached are made heaps, in that order; a
# heap orders its bucket exactly, so the order is the same as one heap's. Reading every
# slot of the trainer remains, and at large T x C, where the slots are out of the CPU's
# caches, it is most of the cost (bench/planner.py's stream: 10 ms an iteration at T = 32
# for gathering and taking 800 victims of each trainer, against 11 for one heap each).
@inlined
def top_victim(
    slot: np.ndarray,
    heaps: np.ndarray,
    starts: np.ndarray,
    info: np.ndarray,
    j: int,
    x: int,
    horizon: int,
) -> int:
    """Trainer j's best remaining capacity victim at x (a slot), or -1; its next use is
    `victim_next`. Gathers them on the first call at x."""
    if info[j, VICTIMS_BUILT_AT] != x:
        _gather_victims(slot, heaps, starts, info, j, x, horizon)
    lo = info[j, VICTIMS_LO]
    return heaps[j, lo, VICTIM_SLOT] if lo < info[j, VICTIMS_HI] else -1


@inlined
def victim_next(heaps: np.ndarray, info: np.ndarray, j: int) -> int:
    """The next use of trainer j's top victim (`top_victim` found one)."""
    return heaps[j, info[j, VICTIMS_LO], VICTIM_NEXT]


@inlined
def pop_victim(heaps: np.ndarray, starts: np.ndarray, info: np.ndarray, j: int) -> int:
    """Take trainer j's top victim (`top_victim` found one); its slot."""
    lo, hi = info[j, VICTIMS_LO], info[j, VICTIMS_HI] - 1
    top = heaps[j, lo, VICTIM_SLOT]
    for c in range(NUM_VICTIM):
        heaps[j, lo, c] = heaps[j, hi, c]
    info[j, VICTIMS_HI] = hi
    if hi > lo:
        _sift_victim(heaps, j, lo, 0, hi - lo)
    else:
        _open_bucket(heaps, starts, info, j, info[j, VICTIMS_BUCKET] + 1)
    return top


# Buckets: rank 0 is NEVER, rank r the next use horizon + 1 - r, for r up to `ranks` =
# horizon - x + 1 (a next use at x or before, which no victim has, would go last); rank r
# goes to bucket r * scale >> _SCALE_BITS, scale = (VICTIM_BUCKETS << _SCALE_BITS) //
# (ranks + 1): in order, and below VICTIM_BUCKETS. A multiply, where a division per copy
# would cost more than the rest of the pass.
_SCALE_BITS = 32


@inlined
def _bucket(nxt: int, horizon: int, ranks: int, scale: int) -> int:
    """The bucket of a victim whose next use is `nxt` (NEVER past the window)."""
    rank = 0 if nxt == NEVER else min(horizon + 1 - nxt, ranks)
    return (rank * scale) >> _SCALE_BITS


@kernel
def _gather_victims(
    slot: np.ndarray, heaps: np.ndarray, starts: np.ndarray, info: np.ndarray,
    j: int, x: int, horizon: int,
) -> None:  # fmt: skip
    """Trainer j's copies not used at x into its buckets (`starts[j]`), the first non-empty
    one made a heap."""
    ranks = horizon - x + 1
    scale = (VICTIM_BUCKETS << _SCALE_BITS) // (ranks + 1)
    for b in range(VICTIM_BUCKETS + 1):
        starts[j, b] = 0
    for s in range(slot.shape[1]):
        if slot[j, s, SLOT_KEY] >= 0 and slot[j, s, SLOT_STAMP] < x:
            b = _bucket(_capped(slot[j, s, SLOT_NEXT], horizon), horizon, ranks, scale)
            starts[j, b + 1] += 1
    for b in range(VICTIM_BUCKETS):
        starts[j, b + 1] += starts[j, b]
    fill = starts[j, :VICTIM_BUCKETS].copy()
    for s in range(slot.shape[1]):
        if slot[j, s, SLOT_KEY] >= 0 and slot[j, s, SLOT_STAMP] < x:
            nxt = _capped(slot[j, s, SLOT_NEXT], horizon)
            b = _bucket(nxt, horizon, ranks, scale)
            n = fill[b]
            fill[b] = n + 1
            heaps[j, n, VICTIM_SLOT] = s
            heaps[j, n, VICTIM_NEXT] = nxt
            heaps[j, n, VICTIM_KEY] = slot[j, s, SLOT_KEY]
    info[j, VICTIMS_BUILT_AT] = x
    _open_bucket(heaps, starts, info, j, 0)


@inlined
def _capped(nxt: int, horizon: int) -> int:
    """A next use as rule 4 ranks it: NEVER past the window."""
    return nxt if nxt <= horizon else NEVER


@inlined
def _open_bucket(heaps: np.ndarray, starts: np.ndarray, info: np.ndarray, j: int, b: int) -> None:
    """Take trainer j's victims from its first non-empty bucket from b on, made a heap; an
    empty heap if there is none."""
    while b < VICTIM_BUCKETS and starts[j, b] == starts[j, b + 1]:
        b += 1
    lo = starts[j, b] if b < VICTIM_BUCKETS else 0
    n = starts[j, b + 1] - lo if b < VICTIM_BUCKETS else 0
    info[j, VICTIMS_BUCKET] = b
    info[j, VICTIMS_LO] = lo
    info[j, VICTIMS_HI] = lo + n
    for i in range(n // 2 - 1, -1, -1):
        _sift_victim(heaps, j, lo, i, n)


@inlined
def _sift_victim(heaps: np.ndarray, j: int, lo: int, i: int, n: int) -> None:
    """Move victim i down the heap of n at rows lo.. of trainer j's victims until both
    children come after it."""
    s = heaps[j, lo + i, VICTIM_SLOT]
    nxt, key = heaps[j, lo + i, VICTIM_NEXT], heaps[j, lo + i, VICTIM_KEY]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        right = child + 1
        if right < n and _goes_first(
            heaps[j, lo + right, VICTIM_NEXT],
            heaps[j, lo + right, VICTIM_KEY],
            heaps[j, lo + child, VICTIM_NEXT],
            heaps[j, lo + child, VICTIM_KEY],
        ):
            child = right
        below = lo + child
        if not _goes_first(heaps[j, below, VICTIM_NEXT], heaps[j, below, VICTIM_KEY], nxt, key):
            break
        for c in range(NUM_VICTIM):
            heaps[j, lo + i, c] = heaps[j, lo + child, c]
        i = child
    heaps[j, lo + i, VICTIM_SLOT] = s
    heaps[j, lo + i, VICTIM_NEXT] = nxt
    heaps[j, lo + i, VICTIM_KEY] = key


@inlined
def _goes_first(next_a: int, key_a: int, next_b: int, key_b: int) -> bool:
    """Whether victim a goes before victim b (keys differ: a trainer holds a key once)."""
    return next_a > next_b or (next_a == next_b and key_a > key_b)
