"""The planner's state and the event buffers of one planned iteration: all arrays
(`BagpipeState`, `Events`), their columns named in `layout`, made and grown here.

Everything is sized by the caches (T x C) or by the keys and pairs in the window, and the
index also by the keys whose last write-back may still be in flight: when it must grow, it
forgets the versions that every fetch from then on would ask for as -1
(`intmap.reserve_index`). Nothing is sized by T per key: a key's trainers are its records
(`records`). The Python side (oracle/bagpipe.py) grows the index and the ring before a
batch that needs more (`reserve_keys`, `grow_ring`), and the store of entries and records
when reading a batch runs out of it (`grow_store`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from oracle.kernels.intmap import IntMap, new_map, reserve_index
from oracle.kernels.layout import (
    ENTRY_ROWS,
    NEVER,
    NUM_CLASSES,
    NUM_COUNTERS,
    NUM_COUNTS,
    NUM_ENTRY,
    NUM_REC,
    NUM_SLOT,
    NUM_STATS,
    NUM_VICTIM,
    NUM_VICTIMS_INFO,
    POOL_USED,
    RING_SIZE,
    SLOT_ENTRY,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
    VICTIM_BUCKETS,
)


class BagpipeState(NamedTuple):
    """Mutable planner state, all arrays (oracle/kernels/__init__.py tells what each holds)."""

    slot: np.ndarray  # int64 [T, C, NUM_SLOT]: SLOT_*
    heap: np.ndarray  # int32 [T, C] min-heaps of free slots
    heap_size: np.ndarray  # int64 [T]
    victims: np.ndarray  # int64 [T, C, NUM_VICTIM]: VICTIM_*
    victim_starts: np.ndarray  # int64 [T, VICTIM_BUCKETS + 1]
    victims_info: np.ndarray  # int64 [T, NUM_VICTIMS_INFO]: VICTIMS_*
    victim_bucket: np.ndarray  # int16 [T, C]: each slot's victim bucket at VICTIMS_BUILT_AT
    index: IntMap  # key -> entry, or its last write-back (intmap: CELL_VALUE)
    pool: np.ndarray  # int64 [R, NUM_REC]: the store's rows: records (REC_*), in homes and blocks
    entry: np.ndarray  # int64 [R / ENTRY_ROWS, NUM_ENTRY]: the same store as entries (ENTRY_*)
    entry_free: np.ndarray  # int64 [R / ENTRY_ROWS] stack of freed entries
    pool_free: np.ndarray  # int64 [NUM_CLASSES]: free blocks of each size class
    counters: np.ndarray  # int64 [NUM_COUNTERS]: FREED_ENTRIES, RING_SIZE, POOL_USED, POOL_CLASSES
    occ_entry: np.ndarray  # int64 [ring] entry of occurrence id % ring
    occ_next_use: np.ndarray  # int64 [ring] iteration of the pair's next occurrence, NEVER none yet


def new_state(num_trainers: int, capacity: int, ring: int, entries: int) -> BagpipeState:
    """Empty caches: every slot free; a store with room for `entries` keys in the window with
    their records at home (memory that is only touched as keys come) and `ring` occurrences
    (a power of two); an index with room for the keys of full caches."""
    t, c = num_trainers, capacity
    slot = aligned_empty((t, c, NUM_SLOT))
    slot[:, :, SLOT_KEY] = slot[:, :, SLOT_ENTRY] = slot[:, :, SLOT_STAMP] = -1
    slot[:, :, SLOT_NEXT] = NEVER
    counters = np.zeros(NUM_COUNTERS, np.int64)
    counters[RING_SIZE] = ring
    return BagpipeState(
        slot=slot,
        heap=np.tile(np.arange(c, dtype=np.int32), (t, 1)),
        heap_size=np.full(t, c, np.int64),
        victims=np.zeros((t, c, NUM_VICTIM), np.int64),
        victim_starts=np.zeros((t, VICTIM_BUCKETS + 1), np.int64),
        victims_info=np.full((t, NUM_VICTIMS_INFO), -1, np.int64),
        victim_bucket=np.empty((t, c), np.int16),  # written by each count before any read
        index=new_map(pow2(2 * t * c)),
        **_store(aligned_empty((ENTRY_ROWS * max(entries, 1) * NUM_REC,))),  # filled as handed out
        entry_free=np.empty(max(entries, 1), np.int64),
        pool_free=np.full(NUM_CLASSES, -1, np.int64),
        counters=counters,
        occ_entry=np.empty(ring, np.int64),  # ingest writes an occurrence before any read
        occ_next_use=np.empty(ring, np.int64),
    )


def _store(cells: np.ndarray) -> dict[str, np.ndarray]:
    """The store's two views: rows of records, and entries of ENTRY_ROWS rows."""
    rows = cells.size // NUM_REC
    entries = rows // ENTRY_ROWS
    return {
        "pool": cells.reshape(rows, NUM_REC),
        "entry": cells[: entries * NUM_ENTRY].reshape(entries, NUM_ENTRY),
    }


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised int64 array whose first cell starts a cache line, so that rows of a
    whole number of lines (entries) or of half a line (records, slots) never straddle one:
    numpy promises 16 bytes."""
    size = int(np.prod(shape))
    raw = np.empty(size + _LINE // 8, np.int64)
    skip = (-raw.ctypes.data % _LINE) // 8
    return raw[skip : skip + size].reshape(shape)


_LINE = 64  # bytes


def pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 2)."""
    return 1 << max(n - 1, 1).bit_length()


def reserve_keys(state: BagpipeState, more: int, forget_through: int) -> BagpipeState:
    """The same state with an index at most half full with `more` new keys
    (`reserve_index`); their entries come from the store (`grow_store`)."""
    return state._replace(index=reserve_index(state.index, more, forget_through))


def grow_store(state: BagpipeState) -> BagpipeState:
    """The same state with twice the store's rows (those handed out kept in place, so that
    entry numbers and pool rows stay valid)."""
    used = int(state.counters[POOL_USED])
    cells = aligned_empty((2 * state.pool.size,))
    cells[: used * NUM_REC] = state.pool.reshape(-1)[: used * NUM_REC]
    grown = _store(cells)
    stack = np.empty(grown["entry"].shape[0], np.int64)
    stack[: state.entry_free.size] = state.entry_free
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


def reuse_events(
    ev: Events | None, num_pairs: int, num_keys: int, num_trainers: int, capacity: int, flush_rows: int
) -> Events:
    """Buffers large enough for any iteration with these many pairs and keys (a copy not
    used at x is one of the T x C), made from `ev`'s where each is large enough: its counts
    and stats zeroed and a fresh `pair_slot`, the rest as left (the kernels write before
    they read; the caller copies an iteration's events out before the next). Buffers made
    afresh were tens of MB an iteration at large T, faulted in and zeroed for the few rows
    an iteration fills (numpy asks for huge pages for arrays of 4 MB and more: 2 MB at each
    first touch), and kept until the directives were final. A buffer too small is made
    anew, a quarter larger than asked, so that growing stays rare."""
    rows = _event_rows(num_pairs, num_keys, num_trainers, capacity, flush_rows)
    if ev is None or ev.stats.shape[0] != num_trainers:
        ev = Events(
            pair_slot=np.zeros(0, np.int32),
            **{name: _event_buffer(name, 0, num_trainers) for name in rows},
            stats=np.zeros((num_trainers, NUM_STATS), np.int64),
            counts=np.zeros(NUM_COUNTS, np.int64),
        )
    grown = {
        name: _event_buffer(name, need + need // 4, num_trainers)
        for name, need in rows.items()
        if getattr(ev, name).shape[0] < need
    }
    ev.stats[:] = 0
    ev.counts[:] = 0
    return ev._replace(pair_slot=np.full(num_pairs, -1, np.int32), **grown)


#: Columns of each event buffer that has a row per event (0: one value a row, -1: one per
#: trainer), and its dtype.
_EVENT_COLUMNS = {
    "fetch": (4, np.int64), "join_dst": (3, np.int64), "join_src": (3, np.int64),
    "leave_prev": (3, np.int64), "leave_now": (3, np.int64), "write_prev": (3, np.int64),
    "write_now": (3, np.int64), "flush_prev": (3, np.int64), "group_keys": (0, np.int64),
    "group_slots": (-1, np.int32),
}  # fmt: skip


def _event_rows(
    num_pairs: int, num_keys: int, num_trainers: int, capacity: int, flush_rows: int
) -> dict[str, int]:
    """The most rows each event buffer may need at an iteration of these sizes."""
    copies = min(num_keys * num_trainers, num_trainers * capacity)  # copies not used at x
    fetches = num_pairs + copies  # fetches, and the victims making room for them
    return {
        "fetch": fetches, "join_dst": num_pairs, "join_src": num_keys, "leave_prev": fetches,
        "leave_now": copies, "write_prev": fetches, "write_now": num_keys, "flush_prev": flush_rows,
        "group_keys": num_keys, "group_slots": num_keys,
    }  # fmt: skip


def _event_buffer(name: str, rows: int, num_trainers: int) -> np.ndarray:
    columns, dtype = _EVENT_COLUMNS[name]
    shape = (rows,) if columns == 0 else (rows, num_trainers if columns < 0 else columns)
    return np.empty(shape, dtype)
