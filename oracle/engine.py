"""The bagpipe rules of DESIGN §4, compiled per key with numba.

Same structure as the specification (tests/oracle/reference_planner.py, steps a-f), with the
slow parts replaced by indexable state:

* next uses: every (key, trainer) *pair* read but not yet planned is an occurrence in a ring;
  ``head[pair]`` is its earliest unplanned occurrence, ``tail[pair]`` its latest, and each
  occurrence links to the next, so "next use after x" is one lookup;
* copies: ``rec_of[key]`` is a record with each trainer's slot; each slot knows its key, its
  trainer's next use (``slot_next``, NEVER if none is read yet) and when it was last used or
  filled (``slot_stamp``);
* free slots: one min-heap per trainer (the smallest free slot is handed out);
* Belady victims: sorted once per trainer and iteration, only when a trainer must evict.

Everything is sized by the caches (T x C) or by the keys in the window, never by the tables.
The kernels append events to preallocated arrays and return counts; oracle/planner.py turns
them into directives.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from numba import types
from numba.typed import Dict

NEVER = np.int64(1 << 62)

# Column and cell names of the state and event arrays. Module-level ints are compile-time
# constants to numba, so naming an index costs nothing. They live in this file, and the
# other oracle modules import them from here, because numba's cache notices only changes
# to the source file of a compiled function: a constant edited in another module would
# leave stale compiled kernels behind.

# counters, int64 [2]: engine-wide scalars, in an array so that kernels can change them.
FREE_RECORDS = 0  # records left on the rec_free stack
RING_SIZE = 1  # entries of the occurrence ring (occ_it, occ_next)

# cand_info, int64 [T, 3]: per trainer, its victim candidates (cand, cand_nu).
CAND_BUILT_AT = 0  # the iteration they were sorted for; stale at any other
CAND_COUNT = 1
CAND_TAKEN = 2  # how many were taken: the next candidate's index

# rec_drop and rec_vic, int64 [R, 3]: a record's first rule-3 leaver and lowest victim.
# Both are stamped with the x being planned: rule-3 leavers leave after x, victims after x-1.
LEFT_ITERATION = 0
LEFT_TRAINER = 1
LEFT_SLOT = 2

# Event rows (Events.fetch, join_*, leave_*, write_*; `Planned` in oracle/rules.py).
EV_TRAINER = 0
EV_KEY = 1
EV_SLOT = 2
EV_MIN_VERSION = 3  # fetch rows only
EV_TARGET = 4  # appended by oracle/planner.py when it files a fetch

# Events.counts, int64 [NUM_COUNTS]: rows filled in each event buffer.
N_FETCH = 0
N_JOIN_DST = 1
N_JOIN_SRC = 2
N_GROUPS = 3  # group_keys and group_slots
N_LEAVE_PREV = 4
N_LEAVE_NOW = 5
N_WRITE_PREV = 6
N_WRITE_NOW = 7
NUM_COUNTS = 8

# Events.stats, int64 [T, NUM_STATS]: per trainer, for the iteration planned.
STAT_USES = 0
STAT_HITS = 1  # uses served by a copy resident before the iteration's fetches
STAT_FETCHED = 2  # uses whose row is fetched for this iteration
STAT_JOINED = 3
STAT_OCCUPANCY = 4  # slots held during the iteration
NUM_STATS = 5

# Rows of `_flush_candidates`: the record, then an event row's trainer, key and slot.
FLUSH_REC = 0
FLUSH_TRAINER = 1
FLUSH_KEY = 2
FLUSH_SLOT = 3

# Join sources of `plan_iteration`, int64 [groups, 2]; trainer -1: the key is admitted.
SRC_TRAINER = 0
SRC_SLOT = 1

# Victim records of one iteration, int64 [1 + n]: how many, then the records.
VIC_COUNT = 0


class EngineState(NamedTuple):
    """Mutable planner state, all arrays and typed dicts (see the module docstring)."""

    slot_key: np.ndarray  # int64 [T, C], -1 free
    slot_next: np.ndarray  # int64 [T, C]
    slot_stamp: np.ndarray  # int64 [T, C]
    heap: np.ndarray  # int32 [T, C] min-heaps of free slots
    heap_size: np.ndarray  # int64 [T]
    cand: np.ndarray  # int32 [T, C] victim candidates of the current iteration, best first
    cand_nu: np.ndarray  # int64 [T, C]
    cand_info: np.ndarray  # int64 [T, 3]: CAND_* of cand, cand_nu
    rec_of: Dict  # key -> record
    rec_slot: np.ndarray  # int32 [R, T], -1 no copy
    rec_n: np.ndarray  # int64 [R] copies
    rec_key: np.ndarray  # int64 [R]
    rec_last_use: np.ndarray  # int64 [R]
    rec_drop: np.ndarray  # int64 [R, 3]: LEFT_* of the first rule-3 leaver
    rec_vic: np.ndarray  # int64 [R, 3]: LEFT_* of the lowest victim
    rec_free: np.ndarray  # int64 [R] stack of free records
    counters: np.ndarray  # int64 [2]: FREE_RECORDS, RING_SIZE
    last_wb: Dict  # key -> version of its last planned write-back
    head: Dict  # pair -> earliest unplanned occurrence id
    tail: Dict  # pair -> latest read occurrence id
    occ_it: np.ndarray  # int64 [cap] iteration of occurrence id % cap
    occ_next: np.ndarray  # int64 [cap] next occurrence id of the same pair, -1 unknown


def new_state(num_trainers: int, capacity: int, ring: int) -> EngineState:
    """Empty caches: every slot free, no records, an occurrence ring of `ring` entries."""
    t, c = num_trainers, capacity
    # live records: at most T*C residencies, plus keys admitted at x before victims end theirs
    records = 2 * t * c
    return EngineState(
        slot_key=np.full((t, c), -1, np.int64),
        slot_next=np.full((t, c), NEVER, np.int64),
        slot_stamp=np.full((t, c), -1, np.int64),
        heap=np.tile(np.arange(c, dtype=np.int32), (t, 1)),
        heap_size=np.full(t, c, np.int64),
        cand=np.zeros((t, c), np.int32),
        cand_nu=np.zeros((t, c), np.int64),
        cand_info=np.full((t, 3), -1, np.int64),
        rec_of=Dict.empty(types.int64, types.int64),
        rec_slot=np.full((records, t), -1, np.int32),
        rec_n=np.zeros(records, np.int64),
        rec_key=np.zeros(records, np.int64),
        rec_last_use=np.zeros(records, np.int64),
        rec_drop=np.full((records, 3), -1, np.int64),
        rec_vic=np.full((records, 3), -1, np.int64),
        rec_free=np.arange(records - 1, -1, -1, dtype=np.int64),
        counters=np.array([records, ring], np.int64),
        last_wb=Dict.empty(types.int64, types.int64),
        head=Dict.empty(types.int64, types.int64),
        tail=Dict.empty(types.int64, types.int64),
        occ_it=np.zeros(ring, np.int64),
        occ_next=np.full(ring, -1, np.int64),
    )


def grow_ring(state: EngineState, live_from: int, live_to: int, ring: int) -> EngineState:
    """The same state with an occurrence ring of `ring` entries; ids [live_from, live_to) kept."""
    ids = np.arange(live_from, live_to, dtype=np.int64)
    old = int(state.counters[RING_SIZE])
    occ_it = np.zeros(ring, np.int64)
    occ_next = np.full(ring, -1, np.int64)
    occ_it[ids % ring] = state.occ_it[ids % old]
    occ_next[ids % ring] = state.occ_next[ids % old]
    state.counters[RING_SIZE] = ring
    return state._replace(occ_it=occ_it, occ_next=occ_next)


class Events(NamedTuple):
    """Event buffers of one planned iteration; column meaning per buffer in `plan_iteration`."""

    pair_slot: np.ndarray  # int32 [P]
    fetch: np.ndarray  # int64 [n, 4]: EV_TRAINER, EV_KEY, EV_SLOT, EV_MIN_VERSION (target = x)
    join_dst: np.ndarray  # int64 [n, 3]: EV_TRAINER, EV_KEY, EV_SLOT
    join_src: np.ndarray  # int64 [n, 3]
    leave_prev: np.ndarray  # int64 [n, 3]: copies leaving after x-1 (victims)
    leave_now: np.ndarray  # int64 [n, 3]: copies leaving after x (rule 3)
    write_prev: np.ndarray  # int64 [n, 3]: writes of version x-1 (victim ends, flushes)
    write_now: np.ndarray  # int64 [n, 3]: writes of version x
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
        write_prev=np.empty((fetches + flush_rows, 3), np.int64),
        write_now=np.empty((num_keys, 3), np.int64),
        group_keys=np.empty(num_keys, np.int64),
        group_slots=np.empty((num_keys, t), np.int32),
        stats=np.zeros((t, NUM_STATS), np.int64),
        counts=np.zeros(NUM_COUNTS, np.int64),
    )


@nb.njit(cache=True)
def lookup(table: Dict, key: int) -> int:
    """table[key], or -1 if absent (`+ 0` turns get's Optional into a plain int64)."""
    return table.get(key, -1) + 0


# --------------------------------------------------------------------------- heaps
@nb.njit(cache=True)
def _heap_push(heap: np.ndarray, size: np.ndarray, j: int, slot: int) -> None:
    h = heap[j]
    i = size[j]
    size[j] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if h[parent] <= slot:
            break
        h[i] = h[parent]
        i = parent
    h[i] = slot


@nb.njit(cache=True)
def _heap_pop(heap: np.ndarray, size: np.ndarray, j: int) -> int:
    h = heap[j]
    top = h[0]
    n = size[j] - 1
    size[j] = n
    last = h[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and h[child + 1] < h[child]:
            child += 1
        if h[child] >= last:
            break
        h[i] = h[child]
        i = child
    if n > 0:
        h[i] = last
    return top


# --------------------------------------------------------------------------- ingest
@nb.njit(cache=True)
def ingest(st: EngineState, z: int, pairs: np.ndarray, base: int, num_trainers: int) -> None:
    """Read batch z: its sorted unique pairs get occurrence ids base, base+1, ...

    Links each pair's previous occurrence to this one and, where the pair had no unplanned
    occurrence, tells the pair's copy (if any) that its next use is now known: z.
    """
    cap = st.counters[RING_SIZE]
    for i in range(pairs.shape[0]):
        p = pairs[i]
        o = base + i
        st.occ_it[o % cap] = z
        st.occ_next[o % cap] = -1
        prev = lookup(st.tail, p)
        st.tail[p] = o
        if prev >= 0:
            st.occ_next[prev % cap] = o
        else:  # head and tail exist together: no unplanned occurrence of p so far
            st.head[p] = o
            rec = lookup(st.rec_of, p // num_trainers)
            if rec >= 0:
                slot = st.rec_slot[rec, p % num_trainers]
                if slot >= 0:
                    st.slot_next[p % num_trainers, slot] = z


# --------------------------------------------------------------------------- records
@nb.njit(cache=True)
def _alloc_rec(st: EngineState, key: int) -> int:
    st.counters[FREE_RECORDS] -= 1
    rec = st.rec_free[st.counters[FREE_RECORDS]]
    st.rec_of[key] = rec
    st.rec_key[rec] = key
    st.rec_n[rec] = 0
    st.rec_drop[rec, LEFT_ITERATION] = -1
    st.rec_vic[rec, LEFT_ITERATION] = -1
    return rec


@nb.njit(cache=True)
def _free_rec(st: EngineState, rec: int) -> None:
    del st.rec_of[st.rec_key[rec]]
    st.rec_free[st.counters[FREE_RECORDS]] = rec
    st.counters[FREE_RECORDS] += 1


@nb.njit(cache=True)
def _add_copy(st: EngineState, rec: int, j: int, slot: int, x: int, nxt: int) -> None:
    st.rec_slot[rec, j] = slot
    st.rec_n[rec] += 1
    st.slot_key[j, slot] = st.rec_key[rec]
    st.slot_stamp[j, slot] = x
    st.slot_next[j, slot] = nxt


@nb.njit(cache=True)
def _remove_copy(st: EngineState, rec: int, j: int, slot: int) -> None:
    """The copy leaves; its slot is free (callers decide from which iteration on)."""
    st.rec_slot[rec, j] = -1
    st.rec_n[rec] -= 1
    st.slot_key[j, slot] = -1
    _heap_push(st.heap, st.heap_size, j, slot)


@nb.njit(cache=True)
def _emit(
    buf: np.ndarray, counts: np.ndarray, which: int, trainer: int, key: int, slot: int
) -> None:
    n = counts[which]
    buf[n, EV_TRAINER] = trainer
    buf[n, EV_KEY] = key
    buf[n, EV_SLOT] = slot
    counts[which] = n + 1


# --------------------------------------------------------------------------- victims
@nb.njit(cache=True)
def _build_candidates(st: EngineState, j: int, x: int, horizon: int) -> None:
    """Rule 4 order of trainer j's copies not used at x: farthest next use first (none in
    the window = NEVER), ties larger key first."""
    capacity = st.slot_key.shape[1]
    slots = np.empty(capacity, np.int64)
    n = 0
    for s in range(capacity):
        if st.slot_key[j, s] >= 0 and st.slot_stamp[j, s] < x:
            slots[n] = s
            n += 1
    slots = slots[:n]
    keys = st.slot_key[j][slots]
    nus = st.slot_next[j][slots]
    for i in range(n):
        if nus[i] > horizon:
            nus[i] = NEVER
    if n and keys.max() < np.int64(1) << 40 and horizon - x < (1 << 21):
        # one sort on (distance to the next use, key): both fit one int64, keys are unique
        score = np.empty(n, np.int64)
        for i in range(n):
            ahead = min(nus[i], horizon + 1) - x
            score[i] = (ahead << 40) | keys[i]
        order = np.argsort(score)
    else:
        order = np.argsort(keys, kind="mergesort")
        order = order[np.argsort(nus[order], kind="mergesort")]
    for i in range(n):
        st.cand[j, i] = slots[order[n - 1 - i]]
        st.cand_nu[j, i] = nus[order[n - 1 - i]]
    st.cand_info[j, CAND_BUILT_AT] = x
    st.cand_info[j, CAND_COUNT] = n
    st.cand_info[j, CAND_TAKEN] = 0


@nb.njit(cache=True)
def _evict(st: EngineState, ev: Events, j: int, slot: int, x: int, vic_recs: np.ndarray) -> None:
    """Capacity victim: leaves after x-1, its slot is free for x."""
    key = st.slot_key[j, slot]
    rec = st.rec_of[key]
    _remove_copy(st, rec, j, slot)
    _emit(ev.leave_prev, ev.counts, N_LEAVE_PREV, j, key, slot)
    if st.rec_vic[rec, LEFT_ITERATION] != x:
        vic_recs[vic_recs[VIC_COUNT] + 1] = rec
        vic_recs[VIC_COUNT] += 1
        st.rec_vic[rec, LEFT_ITERATION] = x
        st.rec_vic[rec, LEFT_TRAINER] = j
        st.rec_vic[rec, LEFT_SLOT] = slot
    elif j < st.rec_vic[rec, LEFT_TRAINER]:
        st.rec_vic[rec, LEFT_TRAINER] = j
        st.rec_vic[rec, LEFT_SLOT] = slot


@nb.njit(cache=True)
def _next_candidate(st: EngineState, j: int, x: int, horizon: int) -> int:
    """Index of trainer j's best remaining victim candidate, or -1."""
    if st.cand_info[j, CAND_BUILT_AT] != x:
        _build_candidates(st, j, x, horizon)
    if st.cand_info[j, CAND_TAKEN] >= st.cand_info[j, CAND_COUNT]:
        return -1
    return st.cand_info[j, CAND_TAKEN]


# --------------------------------------------------------------------------- planning
@nb.njit(cache=True)
def plan_iteration(
    st: EngineState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    base: int,
    num_trainers: int,
    lookahead: int,
    flush: bool,
    flush_after: int,
) -> None:
    """Plan iteration x, whose sorted unique pairs have occurrence ids base, base+1, ...

    `flush`: iteration x-1 is a checkpoint; residencies used after `flush_after` are flushed.
    The rows filled in each event buffer are in ev.counts (N_*).
    """
    t_count = num_trainers
    horizon = x + lookahead
    n_pairs = pairs.shape[0]
    # a. classify keys: group g spans pairs [gstart[g], gstart[g+1])
    gstart = np.empty(n_pairs + 1, np.int64)
    grec = np.empty(n_pairs, np.int64)
    gsrc = np.empty((n_pairs, 2), np.int64)  # join source trainer and slot, or -1
    need = np.zeros(t_count, np.int64)
    n_groups = _classify(st, ev, x, pairs, t_count, gstart, grec, gsrc, need)
    flush = _flush_candidates(st, t_count, flush, flush_after)
    # b. mandatory victims, then slots for the new copies in key order
    vic_recs = np.zeros(ev.fetch.shape[0] + 1, np.int64)
    for j in range(t_count):
        excess = (st.slot_key.shape[1] - st.heap_size[j]) + need[j] - st.slot_key.shape[1]
        for _ in range(excess):
            c = _next_candidate(st, j, x, horizon)
            _evict(st, ev, j, st.cand[j, c], x, vic_recs)
            st.cand_info[j, CAND_TAKEN] += 1
    _assign_new(st, ev, x, pairs, t_count, n_groups, gstart, grec, gsrc)
    # c. admission prefetches for later uses in the window
    for g in range(n_groups):
        if gsrc[g, SRC_TRAINER] < 0:
            _prefetch_later(st, ev, x, pairs[gstart[g]] // t_count, grec[g], t_count, horizon, vic_recs)
    # d. residencies whose last copies were victims end after x-1; checkpoint flushes
    _end_victims(st, ev, x, vic_recs)
    for i in range(flush.shape[0]):
        if st.rec_n[flush[i, FLUSH_REC]] > 0:
            _emit(
                ev.write_prev, ev.counts, N_WRITE_PREV,
                flush[i, FLUSH_TRAINER], flush[i, FLUSH_KEY], flush[i, FLUSH_SLOT],
            )
    # e. G_x
    for g in range(n_groups):
        rec = grec[g]
        if st.rec_n[rec] >= 2:
            n = ev.counts[N_GROUPS]
            ev.group_keys[n] = st.rec_key[rec]
            ev.group_slots[n, :] = st.rec_slot[rec, :]
            ev.counts[N_GROUPS] = n + 1
    for j in range(t_count):
        ev.stats[j, STAT_OCCUPANCY] = st.slot_key.shape[1] - st.heap_size[j]
    # f. residency after the use
    _advance(st, ev, pairs, base, t_count)
    for g in range(n_groups):
        _after_use(st, ev, x, grec[g], t_count, horizon)


@nb.njit(cache=True)
def _classify(
    st: EngineState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    t_count: int,
    gstart: np.ndarray,
    grec: np.ndarray,
    gsrc: np.ndarray,
    need: np.ndarray,
) -> int:
    """Rules 1-2: per key, its record (or -1: admitted) and the lowest-index holder at the
    end of x-1 with its slot (the join source, read before any victim leaves), or -1."""
    n_groups = 0
    last_key = -1
    for i in range(pairs.shape[0]):
        key = pairs[i] // t_count
        j = pairs[i] % t_count
        if key != last_key:
            last_key = key
            rec = lookup(st.rec_of, key)
            gstart[n_groups] = i
            grec[n_groups] = rec
            gsrc[n_groups, SRC_TRAINER] = -1
            if rec >= 0:
                for t in range(t_count):
                    if st.rec_slot[rec, t] >= 0:
                        gsrc[n_groups, SRC_TRAINER] = t
                        gsrc[n_groups, SRC_SLOT] = st.rec_slot[rec, t]
                        break
            n_groups += 1
        g = n_groups - 1
        ev.stats[j, STAT_USES] += 1
        rec = grec[g]
        if rec >= 0 and st.rec_slot[rec, j] >= 0:
            slot = st.rec_slot[rec, j]
            ev.pair_slot[i] = slot
            st.slot_stamp[j, slot] = x
            ev.stats[j, STAT_HITS] += 1
        else:
            need[j] += 1
    gstart[n_groups] = pairs.shape[0]
    return n_groups


@nb.njit(cache=True)
def _flush_candidates(st: EngineState, t_count: int, flush: bool, flush_after: int) -> np.ndarray:
    """Rows [record, trainer, key, slot]: residencies at the end of x-1 used after
    `flush_after`, with their lowest-index copy as writer."""
    if not flush:
        return np.empty((0, 4), np.int64)
    out = np.empty((len(st.rec_of), 4), np.int64)
    n = 0
    for rec in st.rec_of.values():
        if st.rec_last_use[rec] > flush_after:
            for t in range(t_count):
                if st.rec_slot[rec, t] >= 0:
                    out[n, FLUSH_REC] = rec
                    out[n, FLUSH_TRAINER] = t
                    out[n, FLUSH_KEY] = st.rec_key[rec]
                    out[n, FLUSH_SLOT] = st.rec_slot[rec, t]
                    n += 1
                    break
    return out[:n]


@nb.njit(cache=True)
def _assign_new(
    st: EngineState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    t_count: int,
    n_groups: int,
    gstart: np.ndarray,
    grec: np.ndarray,
    gsrc: np.ndarray,
) -> None:
    """Rule 5 for the mandatory new copies (fetches and joins), in key order."""
    for g in range(n_groups):
        key = pairs[gstart[g]] // t_count
        joined = False
        for i in range(gstart[g], gstart[g + 1]):
            if ev.pair_slot[i] >= 0:
                continue
            j = pairs[i] % t_count
            slot = _heap_pop(st.heap, st.heap_size, j)
            if grec[g] < 0:
                grec[g] = _alloc_rec(st, key)
            if gsrc[g, SRC_TRAINER] >= 0 and not joined:
                _emit(
                    ev.join_src, ev.counts, N_JOIN_SRC, gsrc[g, SRC_TRAINER], key, gsrc[g, SRC_SLOT]
                )
                joined = True
            _add_copy(st, grec[g], j, slot, x, NEVER)
            ev.pair_slot[i] = slot
            if gsrc[g, SRC_TRAINER] >= 0:
                _emit(ev.join_dst, ev.counts, N_JOIN_DST, j, key, slot)
                ev.stats[j, STAT_JOINED] += 1
            else:
                _fetch(st, ev, j, key, slot)
                ev.stats[j, STAT_FETCHED] += 1


@nb.njit(cache=True)
def _fetch(st: EngineState, ev: Events, j: int, key: int, slot: int) -> None:
    n = ev.counts[N_FETCH]
    ev.fetch[n, EV_TRAINER] = j
    ev.fetch[n, EV_KEY] = key
    ev.fetch[n, EV_SLOT] = slot
    ev.fetch[n, EV_MIN_VERSION] = lookup(st.last_wb, key)
    ev.counts[N_FETCH] = n + 1


@nb.njit(cache=True)
def _prefetch_later(
    st: EngineState,
    ev: Events,
    x: int,
    key: int,
    rec: int,
    t_count: int,
    horizon: int,
    vic_recs: np.ndarray,
) -> None:
    """Rule 1: a trainer using an admitted key at u in (x, x+L] fetches it now if it has a
    free slot or a victim whose next use is strictly later than u."""
    for j in range(t_count):
        o = lookup(st.head, key * t_count + j)
        if o < 0:
            continue
        u = st.occ_it[o % st.counters[RING_SIZE]]
        # heads are not advanced yet: a trainer using the key at x has u == x
        if u <= x or u > horizon:
            continue
        if st.heap_size[j] == 0:
            c = _next_candidate(st, j, x, horizon)
            if c < 0 or st.cand_nu[j, c] <= u:
                continue
            _evict(st, ev, j, st.cand[j, c], x, vic_recs)
            st.cand_info[j, CAND_TAKEN] += 1
        slot = _heap_pop(st.heap, st.heap_size, j)
        _add_copy(st, rec, j, slot, x, u)
        _fetch(st, ev, j, key, slot)


@nb.njit(cache=True)
def _end_victims(st: EngineState, ev: Events, x: int, vic_recs: np.ndarray) -> None:
    """Rule 4: a residency whose last copies were victims ends after x-1; its writer is the
    lowest-index trainer among the copies leaving after x-1 (rule-3 leavers included)."""
    for i in range(1, vic_recs[VIC_COUNT] + 1):
        rec = vic_recs[i]
        if st.rec_n[rec] > 0:
            continue
        writer = st.rec_vic[rec, LEFT_TRAINER]
        slot = st.rec_vic[rec, LEFT_SLOT]
        if st.rec_drop[rec, LEFT_ITERATION] == x - 1 and st.rec_drop[rec, LEFT_TRAINER] < writer:
            writer = st.rec_drop[rec, LEFT_TRAINER]
            slot = st.rec_drop[rec, LEFT_SLOT]
        key = st.rec_key[rec]
        _emit(ev.write_prev, ev.counts, N_WRITE_PREV, writer, key, slot)
        st.last_wb[key] = x - 1
        _free_rec(st, rec)


@nb.njit(cache=True)
def _advance(st: EngineState, ev: Events, pairs: np.ndarray, base: int, t_count: int) -> None:
    """Move every pair used at x to its next occurrence; its copy learns its next use."""
    cap = st.counters[RING_SIZE]
    for i in range(pairs.shape[0]):
        p = pairs[i]
        o = base + i
        nid = st.occ_next[o % cap]
        nxt = NEVER
        if nid >= 0:
            st.head[p] = nid
            nxt = st.occ_it[nid % cap]
        else:  # o was also the latest occurrence read
            del st.head[p]
            del st.tail[p]
        st.slot_next[p % t_count, ev.pair_slot[i]] = nxt


@nb.njit(cache=True)
def _after_use(st: EngineState, ev: Events, x: int, rec: int, t_count: int, horizon: int) -> None:
    """Rule 3: copies without a use by their trainer in (x, x+L] leave after x, except the
    lowest-index one as keeper when another trainer uses the key in the window."""
    key = st.rec_key[rec]
    stays = 0
    keeper = -1
    for t in range(t_count):
        slot = st.rec_slot[rec, t]
        if slot >= 0:
            if keeper < 0:
                keeper = t
            if st.slot_next[t, slot] <= horizon:
                stays += 1
    if stays == 0:
        used_later = False
        for t in range(t_count):
            o = lookup(st.head, key * t_count + t)
            if o >= 0 and st.occ_it[o % st.counters[RING_SIZE]] <= horizon:
                used_later = True
                break
        if not used_later:
            keeper = -1
    first = -1
    first_slot = -1
    for t in range(t_count):
        slot = st.rec_slot[rec, t]
        if slot < 0 or t == keeper and stays == 0 or st.slot_next[t, slot] <= horizon:
            continue
        _remove_copy(st, rec, t, slot)
        _emit(ev.leave_now, ev.counts, N_LEAVE_NOW, t, key, slot)
        if first < 0:
            first = t
            first_slot = slot
    st.rec_last_use[rec] = x
    if st.rec_n[rec] == 0:
        _emit(ev.write_now, ev.counts, N_WRITE_NOW, first, key, first_slot)
        st.last_wb[key] = x
        _free_rec(st, rec)
    elif first >= 0:
        st.rec_drop[rec, LEFT_ITERATION] = x
        st.rec_drop[rec, LEFT_TRAINER] = first
        st.rec_drop[rec, LEFT_SLOT] = first_slot
