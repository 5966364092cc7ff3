"""The heaps of each trainer's cache: the free slots (a min-heap, the smallest free slot is
handed out) and the Belady victims of iteration x (its copies not used at x, counted only
when that trainer must evict at x, in buckets by next use, each put in order and made a heap
when reached)."""

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
    VICTIMS_FILLED,
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
# one pass over the trainer's slots counts them in VICTIM_BUCKETS buckets by next use and
# notes each slot's bucket (`bucket_of`, two bytes a slot); the victims array then gets
# only the first buckets, about C / 16 victims, from a pass over those notes (a counting
# sort, ranges of `victims` in bucket order), and the next ones, as many again as it
# holds, only if the iteration takes that many. Only the bucket being taken from is made a
# heap; a heap orders its bucket exactly, so the order is the same as one heap's. Reading
# every slot of the trainer once remains, and at large T x C, where the slots are out of
# the CPU's caches, it is most of the cost. Filling every bucket, as an earlier version did, read every slot
# twice and wrote every copy into the victims array: for 32 trainers of 12,540 slots, until
# the first victim can be taken, 10.1 against 4.2 ns a slot where 2% of the copies have no
# use in the window and the rest are spread over it (bench/planner.py's stream has 1-2%),
# 19.7 against 15.9 where half have none (that one bucket is then filled and made a heap).
@inlined
def top_victim(
    slot: np.ndarray,
    bucket_of: np.ndarray,
    heaps: np.ndarray,
    starts: np.ndarray,
    info: np.ndarray,
    j: int,
    x: int,
    horizon: int,
) -> int:
    """Trainer j's best remaining capacity victim at x (a slot), or -1; its next use is
    `victim_next`. Counts them on the first call at x, and fills the victims array with the
    bucket being taken from when it is not in it yet."""
    b = info[j, VICTIMS_BUCKET]
    if info[j, VICTIMS_BUILT_AT] != x or (b < VICTIM_BUCKETS and b >= info[j, VICTIMS_FILLED]):
        _ready_victims(slot, bucket_of, heaps, starts, info, j, x, horizon)
    lo = info[j, VICTIMS_LO]
    return heaps[j, lo, VICTIM_SLOT] if lo < info[j, VICTIMS_HI] else -1


@inlined
def victim_next(heaps: np.ndarray, info: np.ndarray, j: int) -> int:
    """The next use of trainer j's top victim (`top_victim` found one)."""
    return heaps[j, info[j, VICTIMS_LO], VICTIM_NEXT]


@inlined
def pop_victim(heaps: np.ndarray, starts: np.ndarray, info: np.ndarray, j: int) -> int:
    """Take trainer j's top victim (`top_victim` found one, just before); its slot."""
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
#: The fewest victims a fill puts in the victims array (more where C / 16 is more): each
#: fill a pass over two bytes a slot, and a few of them an iteration at most.
_FILL_MIN = 64


@inlined
def _bucket(nxt: int, horizon: int, ranks: int, scale: int) -> int:
    """The bucket of a victim whose next use is `nxt` (NEVER past the window)."""
    rank = 0 if nxt == NEVER else min(horizon + 1 - nxt, ranks)
    return (rank * scale) >> _SCALE_BITS


@kernel
def _ready_victims(
    slot: np.ndarray, bucket_of: np.ndarray, heaps: np.ndarray, starts: np.ndarray, info: np.ndarray,
    j: int, x: int, horizon: int,
) -> None:  # fmt: skip
    """Trainer j's victims at x ready to take: counted on the first call at x, and the
    bucket being taken from put in the victims array and made a heap if it is not in yet
    (one kernel: `top_victim`, inlined where victims are taken, stays small)."""
    if info[j, VICTIMS_BUILT_AT] != x:
        _count_victims(slot, bucket_of, starts, info, j, x, horizon)
        _open_bucket(heaps, starts, info, j, 0)
    b = info[j, VICTIMS_BUCKET]
    if b < VICTIM_BUCKETS and b >= info[j, VICTIMS_FILLED]:
        _fill_victims(slot, bucket_of, heaps, starts, info, j, b, horizon)
        _open_bucket(heaps, starts, info, j, b)


@inlined
def _count_victims(
    slot: np.ndarray, bucket_of: np.ndarray, starts: np.ndarray, info: np.ndarray,
    j: int, x: int, horizon: int,
) -> None:  # fmt: skip
    """Trainer j's copies not used at x counted in their buckets (`starts[j]`), each slot's
    bucket noted (`bucket_of[j]`); none in the victims array yet."""
    ranks = horizon - x + 1
    scale = (VICTIM_BUCKETS << _SCALE_BITS) // (ranks + 1)
    for b in range(VICTIM_BUCKETS + 1):
        starts[j, b] = 0
    for s in range(slot.shape[1]):
        b = VICTIM_BUCKETS
        if slot[j, s, SLOT_KEY] >= 0 and slot[j, s, SLOT_STAMP] < x:
            b = _bucket(_capped(slot[j, s, SLOT_NEXT], horizon), horizon, ranks, scale)
            starts[j, b + 1] += 1
        bucket_of[j, s] = b
    for b in range(VICTIM_BUCKETS):
        starts[j, b + 1] += starts[j, b]
    info[j, VICTIMS_BUILT_AT] = x
    info[j, VICTIMS_FILLED] = 0


@inlined
def _fill_victims(
    slot: np.ndarray, bucket_of: np.ndarray, heaps: np.ndarray, starts: np.ndarray, info: np.ndarray,
    j: int, b: int, horizon: int,
) -> None:  # fmt: skip
    """Trainer j's victims of buckets b, b + 1, ... into the victims array, in slot order,
    until they are C / 16, and as many as are in it already, or the buckets end. The slots
    of those buckets are as they were counted: a copy changes during x only by being taken
    as a victim (or filled at x, no victim then), and those taken so far were in buckets
    filled before."""
    hi = b + 1
    # at least as many as all fills before: a few passes even where an iteration takes most
    want = max(_FILL_MIN, slot.shape[1] >> 4, starts[j, b] - starts[j, 0])
    while hi < VICTIM_BUCKETS and starts[j, hi] - starts[j, b] < want:
        hi += 1
    fill = starts[j, b:hi].copy()
    for s in range(slot.shape[1]):
        k = bucket_of[j, s]
        if b <= k < hi:
            n = fill[k - b]
            fill[k - b] = n + 1
            heaps[j, n, VICTIM_SLOT] = s
            heaps[j, n, VICTIM_NEXT] = _capped(slot[j, s, SLOT_NEXT], horizon)
            heaps[j, n, VICTIM_KEY] = slot[j, s, SLOT_KEY]
    info[j, VICTIMS_FILLED] = hi


@inlined
def _capped(nxt: int, horizon: int) -> int:
    """A next use as rule 4 ranks it: NEVER past the window."""
    return nxt if nxt <= horizon else NEVER


@inlined
def _open_bucket(heaps: np.ndarray, starts: np.ndarray, info: np.ndarray, j: int, b: int) -> None:
    """Take trainer j's victims from its first non-empty bucket from b on, made a heap if it
    is in the victims array (`top_victim` fills it first otherwise); an empty heap if there
    is none."""
    while b < VICTIM_BUCKETS and starts[j, b] == starts[j, b + 1]:
        b += 1
    lo = starts[j, b] if b < VICTIM_BUCKETS else 0
    n = starts[j, b + 1] - lo if b < VICTIM_BUCKETS else 0
    info[j, VICTIMS_BUCKET] = b
    info[j, VICTIMS_LO] = lo
    info[j, VICTIMS_HI] = lo + n
    if b < info[j, VICTIMS_FILLED]:
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
