"""A trainer's copy of a key comes and goes, and the events planning emits: helpers of the
planning steps (oracle/kernels/plan.py), inlined into them.

Each slot holds its key, its entry, its trainer's next use of the key (NEVER if none is
read yet) and when it was last used or filled (`layout`: SLOT_*); the trainer's record of
the key (`records`) holds the copy's slot (REC_SLOT), and the entry the number of copies.
"""

from __future__ import annotations

import numpy as np

from oracle.kernels.heaps import push_free_slot
from oracle.kernels.cache import inlined
from oracle.kernels.layout import (
    ENTRY_COPIES,
    ENTRY_KEY,
    ENTRY_LAST_WB,
    EV_KEY,
    EV_MIN_VERSION,
    EV_SLOT,
    EV_TRAINER,
    LEFT_ITERATION,
    LEFT_SLOT,
    LEFT_TRAINER,
    N_FETCH,
    REC_HEAD,
    REC_SLOT,
    SLOT_ENTRY,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
)


@inlined
def add_copy(
    entry: np.ndarray, pool: np.ndarray, slot: np.ndarray, e: int, r: int, j: int, s: int, x: int
) -> None:
    """Trainer j (record r of entry e) holds a copy of the entry's key in slot s, filled for x."""
    pool[r, REC_SLOT] = s
    entry[e, ENTRY_COPIES] += 1
    slot[j, s, SLOT_KEY] = entry[e, ENTRY_KEY]
    slot[j, s, SLOT_ENTRY] = e
    slot[j, s, SLOT_NEXT] = pool[r, REC_HEAD]
    slot[j, s, SLOT_STAMP] = x


@inlined
def remove_copy(
    entry: np.ndarray,
    pool: np.ndarray,
    slot: np.ndarray,
    heap: np.ndarray,
    heap_size: np.ndarray,
    e: int,
    r: int,
    j: int,
    s: int,
) -> None:
    """Trainer j's copy (record r of entry e) leaves slot s; the slot is free (callers
    decide from which iteration on). The record stays until `records.compact_records`."""
    pool[r, REC_SLOT] = -1
    entry[e, ENTRY_COPIES] -= 1
    slot[j, s, SLOT_KEY] = -1
    slot[j, s, SLOT_ENTRY] = -1
    push_free_slot(heap, heap_size, j, s)


@inlined
def stamp_left(entry: np.ndarray, e: int, which: int, x: int, j: int, s: int) -> None:
    """Stamp the ENTRY_DROP or ENTRY_VIC cells of entry e."""
    entry[e, which + LEFT_ITERATION] = x
    entry[e, which + LEFT_TRAINER] = j
    entry[e, which + LEFT_SLOT] = s


@inlined
def emit(
    buf: np.ndarray, counts: np.ndarray, which: int, trainer: int, key: int, slot: int
) -> None:
    """Append the event row (trainer, key, slot) to `buf`, whose rows counts[which] counts."""
    n = counts[which]
    buf[n, EV_TRAINER] = trainer
    buf[n, EV_KEY] = key
    buf[n, EV_SLOT] = slot
    counts[which] = n + 1


@inlined
def emit_fetch(
    fetch: np.ndarray, counts: np.ndarray, entry: np.ndarray, j: int, e: int, s: int
) -> None:
    """Append trainer j's fetch of entry e's key into slot s, of its last write-back's
    version or later."""
    n = counts[N_FETCH]
    fetch[n, EV_TRAINER] = j
    fetch[n, EV_KEY] = entry[e, ENTRY_KEY]
    fetch[n, EV_SLOT] = s
    fetch[n, EV_MIN_VERSION] = entry[e, ENTRY_LAST_WB]
    counts[N_FETCH] = n + 1
