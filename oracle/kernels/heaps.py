"""The heaps of each trainer's cache: the free slots (a min-heap, the smallest free slot is
handed out) and the Belady victims of iteration x (a max-heap of its copies not used at x,
built only when that trainer must evict at x)."""

from __future__ import annotations

import numpy as np

from oracle.kernels.cache import inlined, kernel
from oracle.kernels.layout import (
    NEVER,
    NUM_VICTIM,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
    VICTIM_KEY,
    VICTIM_NEXT,
    VICTIM_SLOT,
    VICTIMS_BUILT_AT,
    VICTIMS_LEFT,
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
@inlined
def top_victim(
    slot: np.ndarray, heaps: np.ndarray, info: np.ndarray, j: int, x: int, horizon: int
) -> int:
    """Trainer j's best remaining capacity victim at x (a slot), or -1. Rule 4's order:
    its copies not used at x, farthest next use first (none in the window = NEVER), ties
    larger key first; the next use is `heaps[j, 0, VICTIM_NEXT]`."""
    if info[j, VICTIMS_BUILT_AT] != x:
        _build_victims(slot, heaps, info, j, x, horizon)
    return heaps[j, 0, VICTIM_SLOT] if info[j, VICTIMS_LEFT] > 0 else -1


@kernel
def _build_victims(
    slot: np.ndarray, heaps: np.ndarray, info: np.ndarray, j: int, x: int, horizon: int
) -> None:
    """Heap of trainer j's copies not used at x. A heap, not a sorted list: an iteration
    takes few victims from tens of thousands of copies."""
    n = 0
    for s in range(slot.shape[1]):
        if slot[j, s, SLOT_KEY] >= 0 and slot[j, s, SLOT_STAMP] < x:
            nxt = slot[j, s, SLOT_NEXT]
            heaps[j, n, VICTIM_SLOT] = s
            heaps[j, n, VICTIM_NEXT] = nxt if nxt <= horizon else NEVER
            heaps[j, n, VICTIM_KEY] = slot[j, s, SLOT_KEY]
            n += 1
    for i in range(n // 2 - 1, -1, -1):
        _sift_victim(heaps, j, i, n)
    info[j, VICTIMS_BUILT_AT] = x
    info[j, VICTIMS_LEFT] = n


@inlined
def pop_victim(heaps: np.ndarray, info: np.ndarray, j: int) -> int:
    """Take trainer j's top victim off its heap; its slot."""
    top = heaps[j, 0, VICTIM_SLOT]
    n = info[j, VICTIMS_LEFT] - 1
    info[j, VICTIMS_LEFT] = n
    for c in range(NUM_VICTIM):
        heaps[j, 0, c] = heaps[j, n, c]
    _sift_victim(heaps, j, 0, n)
    return top


@inlined
def _sift_victim(heaps: np.ndarray, j: int, i: int, n: int) -> None:
    """Move victim i down trainer j's heap of n until both children come after it."""
    s, nxt, key = heaps[j, i, VICTIM_SLOT], heaps[j, i, VICTIM_NEXT], heaps[j, i, VICTIM_KEY]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        right = child + 1
        if right < n and _goes_first(
            heaps[j, right, VICTIM_NEXT],
            heaps[j, right, VICTIM_KEY],
            heaps[j, child, VICTIM_NEXT],
            heaps[j, child, VICTIM_KEY],
        ):
            child = right
        if not _goes_first(heaps[j, child, VICTIM_NEXT], heaps[j, child, VICTIM_KEY], nxt, key):
            break
        for c in range(NUM_VICTIM):
            heaps[j, i, c] = heaps[j, child, c]
        i = child
    heaps[j, i, VICTIM_SLOT] = s
    heaps[j, i, VICTIM_NEXT] = nxt
    heaps[j, i, VICTIM_KEY] = key


@inlined
def _goes_first(next_a: int, key_a: int, next_b: int, key_b: int) -> bool:
    """Whether victim a goes before victim b (keys differ: a trainer holds a key once)."""
    return next_a > next_b or (next_a == next_b and key_a > key_b)
