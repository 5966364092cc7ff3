"""Reading batch z into the planner's window (`ingest`): every key gets an entry, every
(key, trainer) pair a record and an occurrence.

Every (key, trainer) *pair* read but not yet planned is an occurrence in a ring that knows
its key's entry and, once the pair is read again, that next occurrence's iteration. The
pair's record holds its latest occurrence (``tail``), so reading a batch links each pair,
and planning moves each pair's head (oracle/kernels/plan.py), without a hash lookup per
pair: one per key, for its entry.
"""

from __future__ import annotations

import numpy as np

from common.cpu_prefetch import prefetch_row
from oracle.kernels.intmap import CELL_KEY, CELL_VALUE, map_find, map_home
from oracle.kernels.cache import inlined, kernel
from oracle.kernels.layout import (
    ENTRY_BLOCK,
    ENTRY_CLASS,
    ENTRY_COPIES,
    ENTRY_KEY,
    ENTRY_LAST_USE,
    ENTRY_LAST_WB,
    ENTRY_RECORDS,
    HOME_CLASS,
    HOME_RECORDS,
    NEVER,
    REC_HEAD,
    REC_SLOT,
    REC_TAIL,
    REC_TRAINER,
    RING_SIZE,
    SLOT_NEXT,
)
from oracle.kernels.records import (
    block_class,
    copy_record,
    give_block,
    home_of,
    prefetch_block,
    prefetch_entry,
    room_of,
    take_block,
    take_entry,
)
from oracle.kernels.state import BagpipeState

# How far ahead (in keys) reading a batch prefetches: a key's index cell 2 _AHEAD keys
# ahead, its entry (with its home) _AHEAD keys ahead, once the cell is in; a block, the rare
# home of more than HOME_RECORDS records, _AHEAD / 2 keys ahead, once the entry is in.
_AHEAD = 8
_RING = 4 * _AHEAD  # cells found ahead, by key position modulo _RING


@kernel
def ingest(
    st: BagpipeState,
    z: int,
    pairs: np.ndarray,
    keys: np.ndarray,
    base: int,
    num_trainers: int,
    start: int,
) -> int:
    """Read batch z from its key `start` on: its sorted unique pairs get occurrence ids
    base, base+1, ...; `keys` are its distinct keys, ascending. Returns where it stopped:
    ``keys.shape[0]``, or the first key that found no room in the store (grow it,
    `state.grow_store`, and call again from there: nothing of that key has been read).

    Links each pair's previous occurrence to this one and, where the pair had no unplanned
    occurrence, tells the pair's copy (if any) that its next use is now known: z.
    """
    occ_entry, occ_next_use, entry = st.occ_entry, st.occ_next_use, st.entry
    pool, pool_free, slot = st.pool, st.pool_free, st.slot
    cells, entry_free, counters = st.index.cells, st.entry_free, st.counters
    mask = counters[RING_SIZE] - 1
    n_keys = keys.shape[0]
    found = np.empty(_RING, np.int64)  # a key's cell, once found ahead; -1: not yet in the map
    for k in range(start, min(start + _AHEAD, n_keys)):
        _look_ahead(cells, entry, pool, keys, k, found)
    for k in range(start + _AHEAD, min(start + 2 * _AHEAD, n_keys)):
        prefetch_row(cells, map_home(cells, keys[k]))
    i = np.searchsorted(pairs, keys[start] * num_trainers) if start < n_keys else pairs.shape[0]
    new_keys = 0
    k = start
    while k < n_keys:
        if k + 2 * _AHEAD < n_keys:
            prefetch_row(cells, map_home(cells, keys[k + 2 * _AHEAD]))
        if k + _AHEAD < n_keys:
            _look_ahead(cells, entry, pool, keys, k + _AHEAD, found)
        if num_trainers > HOME_RECORDS and k + _AHEAD // 2 < n_keys:  # only then are there blocks
            c = found[(k + _AHEAD // 2) % _RING]
            if c >= 0 and cells[c, CELL_VALUE] >= 0:
                prefetch_block(entry, pool, cells[c, CELL_VALUE])
        key = keys[k]
        first_pair = key * num_trainers  # trainer j's pair; the next key's pairs come after j < T
        stop = i + 1
        while stop < pairs.shape[0] and pairs[stop] < first_pair + num_trainers:
            stop += 1
        c = found[k % _RING]
        if c < 0:  # not in the map when looked up ahead: keys read since may have moved its cell
            c = map_find(cells, key)
        known = cells[c, CELL_KEY] >= 0
        e = cells[c, CELL_VALUE] if known else -1
        if e >= 0:
            have = entry[e, ENTRY_RECORDS]
            want = have + _new_trainers(pool, entry, e, pairs, i, stop, first_pair)
            room, src, old_class = room_of(entry, e), entry[e, ENTRY_BLOCK], entry[e, ENTRY_CLASS]
        else:
            have, want, room, src, old_class = 0, stop - i, HOME_RECORDS, -1, HOME_CLASS
        dst, new_class = src, old_class
        if want > room:
            new_class = block_class(want)
            dst = take_block(pool, pool_free, counters, new_class)
            if dst < 0:
                break
        if e < 0:
            e = take_entry(pool, entry_free, counters)
            if e < 0:
                if new_class != HOME_CLASS:
                    give_block(pool, pool_free, counters, dst, new_class)
                break
            new_keys += not known
            _new_entry(cells, c, key, e, entry)
            if new_class == HOME_CLASS:
                dst = home_of(e)
        _merge(
            pool, slot, occ_entry, occ_next_use, mask, pairs, i, stop, first_pair, z, base,
            e, src, have, dst, want,
        )
        if dst != src and old_class != HOME_CLASS:
            give_block(pool, pool_free, counters, src, old_class)
        entry[e, ENTRY_BLOCK] = dst
        entry[e, ENTRY_RECORDS] = want
        entry[e, ENTRY_CLASS] = new_class
        i = stop
        k += 1
    st.index.size[0] += new_keys
    return k


@inlined
def _look_ahead(
    cells: np.ndarray,
    entry: np.ndarray,
    pool: np.ndarray,
    keys: np.ndarray,
    k: int,
    found: np.ndarray,
) -> None:
    """Find key k's cell (prefetched earlier) and start loading its entry, if it has one."""
    c = map_find(cells, keys[k])
    if cells[c, CELL_KEY] < 0:
        found[k % _RING] = -1
        return
    found[k % _RING] = c
    if cells[c, CELL_VALUE] >= 0:
        prefetch_entry(entry, pool, cells[c, CELL_VALUE], 2)


@inlined
def _new_trainers(
    pool: np.ndarray,
    entry: np.ndarray,
    e: int,
    pairs: np.ndarray,
    start: int,
    stop: int,
    first_pair: int,
) -> int:
    """How many of pairs [start, stop) (one key's, ascending; trainer j's is first_pair + j)
    belong to trainers without a record of entry e."""
    r = entry[e, ENTRY_BLOCK]
    end = r + entry[e, ENTRY_RECORDS]
    fresh = 0
    for i in range(start, stop):
        j = pairs[i] - first_pair
        while r < end and pool[r, REC_TRAINER] < j:
            r += 1
        if r < end and pool[r, REC_TRAINER] == j:
            r += 1
        else:
            fresh += 1
    return fresh


@inlined
def _merge(
    pool: np.ndarray,
    slot: np.ndarray,
    occ_entry: np.ndarray,
    occ_next_use: np.ndarray,
    mask: int,
    pairs: np.ndarray,
    start: int,
    stop: int,
    first_pair: int,
    z: int,
    base: int,
    e: int,
    src: int,
    have: int,
    dst: int,
    want: int,
) -> None:
    """Entry e's `have` records at pool row `src`, merged with the pairs [start, stop) of
    its key (trainer j's is first_pair + j) into `want` records at row `dst`, ascending by
    trainer; each pair's occurrence linked. From the back, so that `dst` may be `src`: a row
    is written only once it has been read."""
    a = have - 1
    w = want - 1
    for i in range(stop - 1, start - 1, -1):
        j = pairs[i] - first_pair
        o = base + i
        occ_entry[o & mask] = e
        occ_next_use[o & mask] = NEVER
        while a >= 0 and pool[src + a, REC_TRAINER] > j:
            copy_record(pool, src + a, dst + w)
            a -= 1
            w -= 1
        r = dst + w
        w -= 1
        if a >= 0 and pool[src + a, REC_TRAINER] == j:
            copy_record(pool, src + a, r)
            a -= 1
            prev = pool[r, REC_TAIL]
            pool[r, REC_TAIL] = o
            if prev >= 0:
                occ_next_use[prev & mask] = z
                continue
        else:
            pool[r, REC_TRAINER] = j
            pool[r, REC_TAIL] = o
            pool[r, REC_SLOT] = -1
        # no unplanned occurrence of the pair so far
        pool[r, REC_HEAD] = z
        s = pool[r, REC_SLOT]
        if s >= 0:
            slot[j, s, SLOT_NEXT] = z
    while a >= 0:
        copy_record(pool, src + a, dst + w)
        a -= 1
        w -= 1


@inlined
def _new_entry(cells: np.ndarray, c: int, key: int, e: int, entry: np.ndarray) -> None:
    """Entry e for `key` (index cell c): no copies, no records yet (they go home), the last
    write-back kept in the cell if it has one."""
    last_wb = -2 - cells[c, CELL_VALUE] if cells[c, CELL_KEY] >= 0 else -1
    cells[c, CELL_KEY] = key
    cells[c, CELL_VALUE] = e
    entry[e, ENTRY_KEY] = key
    entry[e, ENTRY_COPIES] = 0
    entry[e, ENTRY_LAST_USE] = -1
    entry[e, ENTRY_LAST_WB] = last_wb
    entry[e, ENTRY_BLOCK] = home_of(e)
    entry[e, ENTRY_RECORDS] = 0
    entry[e, ENTRY_CLASS] = HOME_CLASS
