"""Planning iteration x by the bagpipe rules (`plan_iteration`): steps a-f of the
specification (tests/oracle/reference_planner.py), each one kernel over the iteration's keys.

The steps append events to preallocated arrays (`state.Events`) and count them;
oracle/bagpipe.py hands them on and oracle/planner.py turns them into directives.
"""

from __future__ import annotations

import numpy as np

from common.cpu_prefetch import prefetch_row
from oracle.kernels.copies import add_copy, emit, emit_fetch, remove_copy, stamp_left
from oracle.kernels.heaps import pop_free_slot, pop_victim, top_victim, victim_next
from oracle.kernels.intmap import CELL_VALUE, map_find
from oracle.kernels.cache import inlined, kernel
from oracle.kernels.layout import (
    ENTRY_BLOCK,
    ENTRY_CLASS,
    ENTRY_COPIES,
    ENTRY_DROP,
    ENTRY_KEY,
    ENTRY_LAST_USE,
    ENTRY_LAST_WB,
    ENTRY_RECORDS,
    ENTRY_LINES,
    ENTRY_VIC,
    HOME_CLASS,
    HOME_RECORDS,
    LEFT_ITERATION,
    LEFT_SLOT,
    LEFT_TRAINER,
    N_FLUSH_PREV,
    N_GROUPS,
    N_JOIN_DST,
    N_JOIN_SRC,
    N_LEAVE_NOW,
    N_LEAVE_PREV,
    N_WRITE_NOW,
    N_WRITE_PREV,
    NEVER,
    REC_HEAD,
    REC_SLOT,
    REC_TAIL,
    REC_TRAINER,
    RING_SIZE,
    SLOT_ENTRY,
    SLOT_KEY,
    SLOT_NEXT,
    SLOT_STAMP,
    STAT_FETCHED,
    STAT_HITS,
    STAT_JOINED,
    STAT_OCCUPANCY,
    STAT_USES,
)
from oracle.kernels.records import (
    compact_records,
    give_block,
    give_entry,
    lowest_holder,
    prefetch_block,
    prefetch_entry,
    record_of,
)
from oracle.kernels.state import BagpipeState, Events

# Rows of `_flush_candidates`: the entry, then an event row's trainer, key and slot.
FLUSH_ENTRY = 0
FLUSH_TRAINER = 1
FLUSH_KEY = 2
FLUSH_SLOT = 3

# Groups of `plan_iteration`, int64 [keys + 1, NUM_GROUP]: per key used at x, in key order.
GROUP_START = 0  # its pairs are [GROUP_START of this row, GROUP_START of the next row)
GROUP_ENTRY = 1
GROUP_SRC = 2  # the join source: lowest-index holder at the end of x-1; -1 admitted
GROUP_SRC_SLOT = 3
NUM_GROUP = 4

# Victim entries of one iteration, int64 [1 + n]: how many, then the entries.
VIC_COUNT = 0

# How far ahead the per-key loops prefetch entries: far enough for memory to answer, near
# enough for the rows to still be in cache (measured on the bench stream).
_AHEAD_PAIRS = 24
_AHEAD_KEYS = 8


@kernel
def plan_iteration(
    st: BagpipeState,
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
    horizon = x + lookahead
    # a. classify keys
    groups = np.empty((pairs.shape[0] + 1, NUM_GROUP), np.int64)
    pair_rec = np.empty(pairs.shape[0], np.int64)  # each pair's record: blocks stay put while planning
    need = np.zeros(num_trainers, np.int64)
    n_groups = _classify(st, ev, x, pairs, base, groups, pair_rec, need)
    groups = groups[: n_groups + 1]
    flush_rows = _flush_candidates(st, flush, flush_after)
    # b. mandatory victims, then slots for the new copies in key order
    ended = np.empty(ev.fetch.shape[0] + 1, np.int64)
    ended[VIC_COUNT] = 0
    _evict_for(st, ev, x, horizon, need, ended)
    _assign_new(st, ev, x, pairs, groups, pair_rec)
    # c. admission prefetches for later uses in the window
    _prefetch_later(st, ev, x, horizon, groups, ended)
    # d. residencies whose last copies were victims end after x-1; checkpoint flushes
    _end_victims(st, ev, x, ended)
    _flush(st, ev, flush_rows)
    capacity = st.slot.shape[1]
    for j in range(num_trainers):
        ev.stats[j, STAT_OCCUPANCY] = capacity - st.heap_size[j]
    # e, f. G_x and residency after the use; then forget the keys that are done
    done = np.empty(n_groups, np.int64)
    n_done = _after_use(st, ev, x, pairs, base, horizon, groups, pair_rec, done)
    _free_entries(st, done, n_done)


@kernel
def _classify(
    st: BagpipeState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    base: int,
    groups: np.ndarray,
    pair_rec: np.ndarray,
    need: np.ndarray,
) -> int:
    """Rules 1-2: per key, its entry and the lowest-index holder at the end of x-1 with its
    slot (the join source, read before any victim leaves), or -1: admitted. Fills `groups`,
    each pair's record (`pair_rec`) and each trainer's `need` of new copies; returns the
    number of keys."""
    occ_entry, entry, pool, slot = st.occ_entry, st.entry, st.pool, st.slot
    pair_slot, stats = ev.pair_slot, ev.stats
    t_count = slot.shape[0]
    mask = st.counters[RING_SIZE] - 1
    n = pairs.shape[0]
    n_groups = 0
    e = -1
    r = -1
    last_key = -1
    for i in range(n):
        key = pairs[i] // t_count
        j = pairs[i] % t_count
        # the entries (with their homes) far ahead, then the blocks of those nearer
        if i + _AHEAD_PAIRS < n:
            prefetch_entry(entry, pool, occ_entry[(base + i + _AHEAD_PAIRS) & mask], 2)
        if t_count > HOME_RECORDS and i + _AHEAD_PAIRS // 2 < n:
            prefetch_block(entry, pool, occ_entry[(base + i + _AHEAD_PAIRS // 2) & mask])
        if key != last_key:
            last_key = key
            e = occ_entry[(base + i) & mask]
            r = entry[e, ENTRY_BLOCK]
            holder = lowest_holder(pool, entry, e)
            groups[n_groups, GROUP_START] = i
            groups[n_groups, GROUP_ENTRY] = e
            groups[n_groups, GROUP_SRC] = pool[holder, REC_TRAINER] if holder >= 0 else -1
            if holder >= 0:
                groups[n_groups, GROUP_SRC_SLOT] = pool[holder, REC_SLOT]
            n_groups += 1
        while pool[r, REC_TRAINER] < j:  # every pair read and not planned has a record
            r += 1
        pair_rec[i] = r
        stats[j, STAT_USES] += 1
        s = pool[r, REC_SLOT]
        if s >= 0:
            pair_slot[i] = s
            stats[j, STAT_HITS] += 1
        else:
            need[j] += 1
    groups[n_groups, GROUP_START] = n
    _stamp_hits(slot, pair_slot, pairs, x)
    return n_groups


@inlined
def _stamp_hits(slot: np.ndarray, pair_slot: np.ndarray, pairs: np.ndarray, x: int) -> None:
    """Stamp the slots used at x that already held their key: a pass of its own, once every
    pair's slot is known, so that each slot's cache line is requested ahead of its write
    (the slots are spread over T x C rows, out of the CPU's caches at large T)."""
    rows = _slot_rows(slot)
    n = pairs.shape[0]
    for i in range(n):
        _prefetch_pair_slot(rows, slot.shape[0], slot.shape[1], pairs, pair_slot, i + _AHEAD_PAIRS)
        s = pair_slot[i]
        if s >= 0:
            slot[pairs[i] % slot.shape[0], s, SLOT_STAMP] = x


@inlined
def _slot_rows(slot: np.ndarray) -> np.ndarray:
    """The slots [T, C, NUM_SLOT] as rows [T x C, NUM_SLOT], a view: a slot's cells as one
    row, to prefetch (`_prefetch_pair_slot`)."""
    return slot.reshape(slot.shape[0] * slot.shape[1], slot.shape[2])


@inlined
def _prefetch_pair_slot(
    rows: np.ndarray, t_count: int, capacity: int, pairs: np.ndarray, pair_slot: np.ndarray, i: int
) -> None:
    """Start loading the slot of pair i, if there is such a pair and it has a slot yet."""
    if i < pairs.shape[0] and pair_slot[i] >= 0:
        prefetch_row(rows, (pairs[i] % t_count) * capacity + pair_slot[i])


@kernel
def _flush_candidates(st: BagpipeState, flush: bool, flush_after: int) -> np.ndarray:
    """Rows [entry, trainer, key, slot]: residencies at the end of x-1 used after
    `flush_after`, with their lowest-index copy as writer."""
    slot, entry, pool = st.slot, st.entry, st.pool
    t_count, capacity = slot.shape[0], slot.shape[1]
    if not flush:
        return np.empty((0, 4), np.int64)
    out = np.empty((t_count * capacity, 4), np.int64)
    n = 0
    for j in range(t_count):
        for s in range(capacity):
            e = slot[j, s, SLOT_ENTRY]
            if (
                e < 0
                or entry[e, ENTRY_LAST_USE] <= flush_after
                or pool[lowest_holder(pool, entry, e), REC_TRAINER] != j
            ):
                continue
            out[n, FLUSH_ENTRY] = e
            out[n, FLUSH_TRAINER] = j
            out[n, FLUSH_KEY] = entry[e, ENTRY_KEY]
            out[n, FLUSH_SLOT] = s
            n += 1
    return out[:n]


@kernel
def _evict_for(
    st: BagpipeState, ev: Events, x: int, horizon: int, need: np.ndarray, ended: np.ndarray
) -> None:
    """Rule 4: each trainer evicts until its `need` new copies at x fit."""
    entry, pool, slot, heap = st.entry, st.pool, st.slot, st.heap
    heap_size = st.heap_size
    heaps, starts, info, bucket_of = st.victims, st.victim_starts, st.victims_info, st.victim_bucket
    leave_prev, counts = ev.leave_prev, ev.counts
    for j in range(need.shape[0]):
        for _ in range(need[j] - heap_size[j]):
            top_victim(slot, bucket_of, heaps, starts, info, j, x, horizon)  # counts them on the first call
            s = pop_victim(heaps, starts, info, j)
            _evict(entry, pool, slot, heap, heap_size, leave_prev, counts, ended, j, s, x)


@inlined
def _evict(
    entry: np.ndarray,
    pool: np.ndarray,
    slot: np.ndarray,
    heap: np.ndarray,
    heap_size: np.ndarray,
    leave_prev: np.ndarray,
    counts: np.ndarray,
    ended: np.ndarray,
    j: int,
    s: int,
    x: int,
) -> None:
    """Trainer j's copy in slot s is a capacity victim: it leaves after x-1, its slot is free
    for x, and its residency may end (`ended`: VIC_COUNT, then the entries)."""
    e = slot[j, s, SLOT_ENTRY]
    emit(leave_prev, counts, N_LEAVE_PREV, j, slot[j, s, SLOT_KEY], s)
    remove_copy(entry, pool, slot, heap, heap_size, e, record_of(pool, entry, e, j), j, s)
    if entry[e, ENTRY_VIC + LEFT_ITERATION] != x:
        ended[ended[VIC_COUNT] + 1] = e
        ended[VIC_COUNT] += 1
        stamp_left(entry, e, ENTRY_VIC, x, j, s)
    elif j < entry[e, ENTRY_VIC + LEFT_TRAINER]:
        stamp_left(entry, e, ENTRY_VIC, x, j, s)


@kernel
def _assign_new(
    st: BagpipeState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    groups: np.ndarray,
    pair_rec: np.ndarray,
) -> None:
    """Rule 5 for the mandatory new copies (fetches and joins), in key order."""
    entry, pool, slot, heap = st.entry, st.pool, st.slot, st.heap
    heap_size = st.heap_size
    pair_slot, fetch, join_src, join_dst = ev.pair_slot, ev.fetch, ev.join_src, ev.join_dst
    counts, stats = ev.counts, ev.stats
    t_count = slot.shape[0]
    for g in range(groups.shape[0] - 1):
        e, src = groups[g, GROUP_ENTRY], groups[g, GROUP_SRC]
        start, stop = groups[g, GROUP_START], groups[g + 1, GROUP_START]
        key = pairs[start] // t_count  # not the entry's: a key all of whose uses hit skips it
        admitted = src < 0
        if admitted:  # a new residency: no leaver or victim of it yet
            entry[e, ENTRY_DROP + LEFT_ITERATION] = -1
            entry[e, ENTRY_VIC + LEFT_ITERATION] = -1
        joined = False
        for i in range(start, stop):
            if pair_slot[i] >= 0:
                continue
            j = pairs[i] % t_count
            s = pop_free_slot(heap, heap_size, j)
            if not admitted and not joined:
                emit(join_src, counts, N_JOIN_SRC, src, key, groups[g, GROUP_SRC_SLOT])
                joined = True
            add_copy(entry, pool, slot, e, pair_rec[i], j, s, x)
            pair_slot[i] = s
            if admitted:
                emit_fetch(fetch, counts, entry, j, e, s)
                stats[j, STAT_FETCHED] += 1
            else:
                emit(join_dst, counts, N_JOIN_DST, j, key, s)
                stats[j, STAT_JOINED] += 1


@kernel
def _prefetch_later(
    st: BagpipeState, ev: Events, x: int, horizon: int, groups: np.ndarray, ended: np.ndarray
) -> None:
    """Rule 1: a trainer using an admitted key at u in (x, x+L] fetches it now if it has a
    free slot or a victim whose next use is strictly later than u. Such a trainer has a
    record of the key (an unplanned use), so only the key's records are looked at."""
    entry, pool, slot, heap = st.entry, st.pool, st.slot, st.heap
    heap_size = st.heap_size
    heaps, starts, info, bucket_of = st.victims, st.victim_starts, st.victims_info, st.victim_bucket
    fetch, leave_prev, counts = ev.fetch, ev.leave_prev, ev.counts
    t_count = slot.shape[0]
    # the admitted keys' entries in a list of their own, to request their cells ahead (the
    # other keys' would be loaded for nothing)
    admitted = np.empty(groups.shape[0] - 1, np.int64)
    n = 0
    for g in range(groups.shape[0] - 1):
        if groups[g, GROUP_SRC] < 0:
            admitted[n] = groups[g, GROUP_ENTRY]
            n += 1
    for i in range(n):
        if i + _AHEAD_KEYS < n:
            prefetch_entry(entry, pool, admitted[i + _AHEAD_KEYS], 2)
        if t_count > HOME_RECORDS and i + _AHEAD_KEYS // 2 < n:
            prefetch_block(entry, pool, admitted[i + _AHEAD_KEYS // 2])
        e = admitted[i]
        first = entry[e, ENTRY_BLOCK]
        for r in range(first, first + entry[e, ENTRY_RECORDS]):
            # heads are not advanced yet: a trainer using the key at x has u == x
            u = pool[r, REC_HEAD]
            if u <= x or u > horizon:
                continue
            j = pool[r, REC_TRAINER]
            if heap_size[j] == 0:
                if (
                    top_victim(slot, bucket_of, heaps, starts, info, j, x, horizon) < 0
                    or victim_next(heaps, info, j) <= u
                ):
                    continue
                s = pop_victim(heaps, starts, info, j)
                _evict(entry, pool, slot, heap, heap_size, leave_prev, counts, ended, j, s, x)
            s = pop_free_slot(heap, heap_size, j)
            add_copy(entry, pool, slot, e, r, j, s, x)
            emit_fetch(fetch, counts, entry, j, e, s)


@kernel
def _end_victims(st: BagpipeState, ev: Events, x: int, ended: np.ndarray) -> None:
    """Rule 4: a residency whose last copies were victims ends after x-1; its writer is the
    lowest-index trainer among the copies leaving after x-1 (rule-3 leavers included). The
    key stays in the window (it had a copy at the end of x-1), so its entry stays."""
    entry, write_prev, counts = st.entry, ev.write_prev, ev.counts
    for i in range(1, ended[VIC_COUNT] + 1):
        e = ended[i]
        if entry[e, ENTRY_COPIES] > 0:
            continue
        writer = entry[e, ENTRY_VIC + LEFT_TRAINER]
        s = entry[e, ENTRY_VIC + LEFT_SLOT]
        if (
            entry[e, ENTRY_DROP + LEFT_ITERATION] == x - 1
            and entry[e, ENTRY_DROP + LEFT_TRAINER] < writer
        ):
            writer = entry[e, ENTRY_DROP + LEFT_TRAINER]
            s = entry[e, ENTRY_DROP + LEFT_SLOT]
        emit(write_prev, counts, N_WRITE_PREV, writer, entry[e, ENTRY_KEY], s)
        entry[e, ENTRY_LAST_WB] = x - 1


@kernel
def _flush(st: BagpipeState, ev: Events, rows: np.ndarray) -> None:
    """Checkpoint flushes (`_flush_candidates`) of the residencies still going: apart from
    the writes that end residencies, since the writer's own copy may be leaving too."""
    entry, flush_prev, counts = st.entry, ev.flush_prev, ev.counts
    for i in range(rows.shape[0]):
        j, key, s = rows[i, FLUSH_TRAINER], rows[i, FLUSH_KEY], rows[i, FLUSH_SLOT]
        if entry[rows[i, FLUSH_ENTRY], ENTRY_COPIES] > 0:
            emit(flush_prev, counts, N_FLUSH_PREV, j, key, s)


@kernel
def _after_use(
    st: BagpipeState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    base: int,
    horizon: int,
    groups: np.ndarray,
    pair_rec: np.ndarray,
    done: np.ndarray,
) -> int:
    """Per key used at x, while its cells are in cache (no key's steps read another key's
    cells): rule 6, G_x; its pairs move to their next occurrences; rule 3, which copies leave
    after x; records left with neither a copy nor an unplanned use are dropped. Returns how
    many keys are done (no copies, no unplanned use), listed in `done`."""
    occ_next_use, entry, pool, slot = st.occ_next_use, st.entry, st.pool, st.slot
    heap, heap_size = st.heap, st.heap_size
    pair_slot, group_keys, group_slots = ev.pair_slot, ev.group_keys, ev.group_slots
    leave_now, write_now, counts = ev.leave_now, ev.write_now, ev.counts
    t_count, capacity = slot.shape[0], slot.shape[1]
    rows = _slot_rows(slot)
    mask = st.counters[RING_SIZE] - 1
    n_groups = groups.shape[0] - 1
    n_done = 0
    for g in range(n_groups):
        if g + _AHEAD_KEYS < n_groups:
            prefetch_entry(entry, pool, groups[g + _AHEAD_KEYS, GROUP_ENTRY], ENTRY_LINES)
        if t_count > HOME_RECORDS and g + _AHEAD_KEYS // 2 < n_groups:
            prefetch_block(entry, pool, groups[g + _AHEAD_KEYS // 2, GROUP_ENTRY])
        e = groups[g, GROUP_ENTRY]
        key = entry[e, ENTRY_KEY]
        if entry[e, ENTRY_COPIES] >= 2:
            _group(group_keys, group_slots, counts, entry, pool, e)
        for i in range(groups[g, GROUP_START], groups[g + 1, GROUP_START]):
            _prefetch_pair_slot(rows, t_count, capacity, pairs, pair_slot, i + _AHEAD_PAIRS)
            j = pairs[i] % t_count
            r = pair_rec[i]
            nxt = occ_next_use[(base + i) & mask]
            pool[r, REC_HEAD] = nxt
            if nxt == NEVER:  # this was also the latest occurrence read
                pool[r, REC_TAIL] = -1
            slot[j, pair_slot[i], SLOT_NEXT] = nxt
        keeper = _keeper(pool, entry, e, horizon)
        first = -1
        block = entry[e, ENTRY_BLOCK]
        for r in range(block, block + entry[e, ENTRY_RECORDS]):
            s = pool[r, REC_SLOT]
            t = pool[r, REC_TRAINER]
            if s < 0 or t == keeper or pool[r, REC_HEAD] <= horizon:
                continue
            emit(leave_now, counts, N_LEAVE_NOW, t, key, s)
            remove_copy(entry, pool, slot, heap, heap_size, e, r, t, s)
            if first < 0:
                first = t
                stamp_left(entry, e, ENTRY_DROP, x, t, s)
        entry[e, ENTRY_LAST_USE] = x
        left = compact_records(pool, entry, e)
        if entry[e, ENTRY_COPIES] == 0:  # the residency ends: its first leaver writes
            emit(write_now, counts, N_WRITE_NOW, first, key, entry[e, ENTRY_DROP + LEFT_SLOT])
            entry[e, ENTRY_LAST_WB] = x
            if left == 0:  # no copy, so the records left are unplanned uses: none
                done[n_done] = e
                n_done += 1
    return n_done


@inlined
def _group(
    group_keys: np.ndarray,
    group_slots: np.ndarray,
    counts: np.ndarray,
    entry: np.ndarray,
    pool: np.ndarray,
    e: int,
) -> None:
    """Add the entry's key to G_x, with every trainer's slot: -1 but for its copies (a row
    of T, as the directives' sync lists give every trainer a position for every key)."""
    n = counts[N_GROUPS]
    group_keys[n] = entry[e, ENTRY_KEY]
    for t in range(group_slots.shape[1]):
        group_slots[n, t] = -1
    first = entry[e, ENTRY_BLOCK]
    for r in range(first, first + entry[e, ENTRY_RECORDS]):
        if pool[r, REC_SLOT] >= 0:
            group_slots[n, pool[r, REC_TRAINER]] = pool[r, REC_SLOT]
    counts[N_GROUPS] = n + 1


@inlined
def _keeper(pool: np.ndarray, entry: np.ndarray, e: int, horizon: int) -> int:
    """Rule 3's keeper after the use: if no copy has a use by its own trainer in the window
    but some trainer uses the key there, the lowest-index copy's trainer; else -1. A
    trainer without a record has neither a copy nor a use."""
    holder = -1
    used_later = False
    first = entry[e, ENTRY_BLOCK]
    for r in range(first, first + entry[e, ENTRY_RECORDS]):
        in_window = pool[r, REC_HEAD] <= horizon
        if pool[r, REC_SLOT] >= 0:
            if in_window:
                return -1
            if holder < 0:
                holder = pool[r, REC_TRAINER]
        used_later |= in_window
    return holder if used_later else -1


@kernel
def _free_entries(st: BagpipeState, done: np.ndarray, n: int) -> None:
    """Keys without copies or unplanned occurrences: their index cells keep only the version
    of their last write-back; their entries and blocks are free."""
    cells, entry, entry_free, counters = st.index.cells, st.entry, st.entry_free, st.counters
    pool, pool_free = st.pool, st.pool_free
    for i in range(n):
        e = done[i]
        cells[map_find(cells, entry[e, ENTRY_KEY]), CELL_VALUE] = -2 - entry[e, ENTRY_LAST_WB]
        if entry[e, ENTRY_CLASS] != HOME_CLASS:
            give_block(pool, pool_free, counters, entry[e, ENTRY_BLOCK], entry[e, ENTRY_CLASS])
        give_entry(entry, entry_free, counters, e)
