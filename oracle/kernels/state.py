"""The planner's state and the event buffers of one planned iteration: all arrays
(`BagpipeState`, `Events`), their columns named in `layout`, made and grown here.

Everything is sized by the caches (T x C) or by the keys in the window, and the index also
by the keys whose last write-back may still be in flight: when it must grow, it forgets the
versions that every fetch from then on would ask for as -1 (`intmap.reserve_index`). The
Python side (oracle/bagpipe.py) grows the index, the entries and the ring before a batch
that needs more (`reserve_entries`, `grow_ring`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from oracle.kernels.intmap import IntMap, new_map, reserve_index
from oracle.kernels.layout import (
    FREED_ENTRIES,
    NEVER,
    NUM_COUNTS,
    NUM_ENTRY,
    NUM_PAIR,
    NUM_SLOT,
    NUM_STATS,
    NUM_VICTIM,
    RING_SIZE,
    SLOT_ENTRY,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
    USED_ENTRIES,
)


class BagpipeState(NamedTuple):
    """Mutable planner state, all arrays (oracle/kernels/__init__.py tells what each holds)."""

    slot: np.ndarray  # int64 [T, C, NUM_SLOT]: SLOT_*
    heap: np.ndarray  # int32 [T, C] min-heaps of free slots
    heap_size: np.ndarray  # int64 [T]
    victims: np.ndarray  # int64 [T, C, NUM_VICTIM]: VICTIM_*
    victims_info: np.ndarray  # int64 [T, 2]: VICTIMS_*
    index: IntMap  # key -> entry, or its last write-back (intmap: CELL_VALUE)
    entry: np.ndarray  # int64 [E, NUM_ENTRY]: ENTRY_*
    entry_pair: np.ndarray  # int64 [E, T, NUM_PAIR]: PAIR_*
    entry_free: np.ndarray  # int64 [E] stack of freed entries
    counters: np.ndarray  # int64 [3]: FREED_ENTRIES, USED_ENTRIES, RING_SIZE
    occ_entry: np.ndarray  # int64 [ring] entry of occurrence id % ring
    occ_next_use: np.ndarray  # int64 [ring] iteration of the pair's next occurrence, NEVER none yet


def new_state(num_trainers: int, capacity: int, ring: int, entries: int) -> BagpipeState:
    """Empty caches: every slot free; room for `entries` keys in the window (memory that is
    only touched as keys come) and `ring` occurrences (a power of two); an index with room
    for the keys of full caches."""
    t, c = num_trainers, capacity
    slot = np.empty((t, c, NUM_SLOT), np.int64)
    slot[:, :, SLOT_KEY] = slot[:, :, SLOT_ENTRY] = slot[:, :, SLOT_STAMP] = -1
    slot[:, :, SLOT_NEXT] = NEVER
    return BagpipeState(
        slot=slot,
        heap=np.tile(np.arange(c, dtype=np.int32), (t, 1)),
        heap_size=np.full(t, c, np.int64),
        victims=np.zeros((t, c, NUM_VICTIM), np.int64),
        victims_info=np.full((t, 2), -1, np.int64),
        index=new_map(pow2(2 * t * c)),
        **_entry_arrays(entries, t),
        entry_free=np.empty(entries, np.int64),
        counters=np.array([0, 0, ring], np.int64),
        occ_entry=np.empty(ring, np.int64),  # ingest writes an occurrence before any read
        occ_next_use=np.empty(ring, np.int64),
    )


def pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 2)."""
    return 1 << max(n - 1, 1).bit_length()


def _entry_arrays(n: int, t: int) -> dict[str, np.ndarray]:
    # uninitialised: ingest fills an entry's cells when it hands the entry out
    return {
        "entry": np.empty((n, NUM_ENTRY), np.int64),
        "entry_pair": np.empty((n, t, NUM_PAIR), np.int64),
    }


def reserve_entries(state: BagpipeState, more: int, forget_through: int) -> BagpipeState:
    """The same state with room for `more` new keys: free entries, and an index at most half
    full with them (`reserve_index`)."""
    freed, used = int(state.counters[FREED_ENTRIES]), int(state.counters[USED_ENTRIES])
    state = state._replace(index=reserve_index(state.index, more, forget_through))
    old = state.entry.shape[0]
    if freed + old - used >= more:
        return state
    n = max(2 * old, used + more)
    grown = _entry_arrays(n, state.entry_pair.shape[1])
    for name, array in grown.items():
        array[:used] = getattr(state, name)[:used]
    stack = np.empty(n, np.int64)
    stack[:freed] = state.entry_free[:freed]
    return state._replace(**grown, entry_free=stack)


def grow_ring(state: BagpipeState, live_from: int, live_to: int, ring: int) -> BagpipeState:
    """The same state with an occurrence ring of `ring` entries (a power of two); ids
    [live_from, live_to) kept."""
    grown = {"occ_entry": np.empty(ring, np.int64), "occ_next_use": np.empty(ring, np.int64)}
    for name, array in grown.items():
        _copy_ids(getattr(state, name), array, live_from, live_to)
    state.counters[RING_SIZE] = ring
    return state._replace(**grown)


def _copy_ids(src: np.ndarray, dst: np.ndarray, start: int, stop: int) -> None:
    """Ring cells of ids [start, stop) from ring `src` into ring `dst`, in contiguous runs."""
    while start < stop:
        a, b = start % src.size, start % dst.size
        run = min(stop - start, src.size - a, dst.size - b)
        dst[b : b + run] = src[a : a + run]
        start += run


class Events(NamedTuple):
    """Event buffers of one planned iteration (`plan.plan_iteration`); columns in `layout`."""

    pair_slot: np.ndarray  # int32 [P]
    fetch: np.ndarray  # int64 [n, 4]: EV_TRAINER, EV_KEY, EV_SLOT, EV_MIN_VERSION (target = x)
    join_dst: np.ndarray  # int64 [n, 3]: EV_TRAINER, EV_KEY, EV_SLOT
    join_src: np.ndarray  # int64 [n, 3]
    leave_prev: np.ndarray  # int64 [n, 3]: copies leaving after x-1 (victims)
    leave_now: np.ndarray  # int64 [n, 3]: copies leaving after x (rule 3)
    write_prev: np.ndarray  # int64 [n, 3]: writes of version x-1 ending residencies (victims)
    write_now: np.ndarray  # int64 [n, 3]: writes of version x
    flush_prev: np.ndarray  # int64 [n, 3]: checkpoint x-1's flushes of residencies going on
    group_keys: np.ndarray  # int64 [n]
    group_slots: np.ndarray  # int32 [n, T]
    stats: np.ndarray  # int64 [T, NUM_STATS]: STAT_*
    counts: np.ndarray  # int64 [NUM_COUNTS]: N_*


def new_events(num_pairs: int, num_keys: int, num_trainers: int, flush_rows: int) -> Events:
    """Buffers large enough for any iteration with these many pairs and keys."""
    t = num_trainers
    fetches = num_pairs + num_keys * t
    return Events(
        pair_slot=np.full(num_pairs, -1, np.int32),
        fetch=np.empty((fetches, 4), np.int64),
        join_dst=np.empty((num_pairs, 3), np.int64),
        join_src=np.empty((num_keys, 3), np.int64),
        leave_prev=np.empty((fetches, 3), np.int64),
        leave_now=np.empty((num_keys * t, 3), np.int64),
        write_prev=np.empty((fetches, 3), np.int64),
        write_now=np.empty((num_keys, 3), np.int64),
        flush_prev=np.empty((flush_rows, 3), np.int64),
        group_keys=np.empty(num_keys, np.int64),
        group_slots=np.empty((num_keys, t), np.int32),
        stats=np.zeros((t, NUM_STATS), np.int64),
        counts=np.zeros(NUM_COUNTS, np.int64),
    )
