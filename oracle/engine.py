"""The planner's numba kernels: the bagpipe rules of DESIGN §4 compiled per key, and the
reading of a batch that every mode shares.

Same structure as the specification (tests/oracle/reference_planner.py, steps a-f), with the
slow parts replaced by indexable state:

* keys: every key read and not yet planned to its last use has an *entry*, found through a
  hash index (`IntMap`). A key with copies always has one, since a copy stays only while some
  trainer uses its key in the window. The entry holds the version of the key's last planned
  write-back and, per trainer, the copy's slot and the iteration of the trainer's earliest
  unplanned use (``head``, NEVER if none). A key whose entry is gone keeps its index cell,
  which then holds that version until no fetch can need it (`reserve_index`): one lookup
  when a key comes and one when it goes;
* next uses: every (key, trainer) *pair* read but not yet planned is an occurrence in a ring
  that knows its key's entry and, once the pair is read again, that next occurrence's
  iteration. The entry holds each pair's latest occurrence (``tail``), so reading a batch
  links each pair, and planning moves each pair's head, without a hash lookup per pair;
* copies: each slot holds its key, its entry, its trainer's next use of the key (NEVER if
  none is read yet) and when it was last used or filled;
* free slots: one min-heap per trainer (the smallest free slot is handed out);
* Belady victims: one max-heap per trainer, built only when that trainer must evict at x.

Everything is sized by the caches (T x C) or by the keys in the window, and the index also
by the keys whose last write-back may still be in flight: when it must grow, it forgets the
versions that every fetch from then on would ask for as -1 (`reserve_index`). The Python
side grows the index, the entries and the ring before a batch that needs more.

Speed. Planning is bound by memory latency and by numba's reference counting. The cells of a
slot, and those of an entry, sit side by side. numba increfs and decrefs an array (atomic
calls, tens of ns each, more than the work around them) whenever code takes it out of a
tuple, and every array of a tuple passed to a function, inlined or not. So each step of
planning is one function, called once per iteration, that takes the state's arrays out once;
the helpers it calls per key or per pair take arrays, never the state, and are inlined
(``inline="always"``). A slice or a view costs the same: hot code indexes cells one at a
time. The per-key loops prefetch the entries of the keys a few steps ahead (`_prefetch`). The kernels append events to preallocated arrays and return counts;
oracle/planner.py turns them into directives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from oracle.kernels.jit import inlined, kernel

NEVER = np.int64(1 << 62)

# Column and cell names of the state and event arrays. Module-level ints are compile-time
# constants to numba, so naming an index costs nothing. They live in this file, and the
# other oracle modules import them from here, because numba's cache notices only changes
# to the source file of a compiled function: a constant edited in another module would
# leave stale compiled kernels behind.

# counters, int64 [3]: engine-wide scalars, in an array so that kernels can change them.
FREED_ENTRIES = 0  # entries on the entry_free stack, handed out again first
USED_ENTRIES = 1  # entries ever handed out: [USED_ENTRIES, E) are untouched memory
RING_SIZE = 2  # entries of the occurrence ring (occ_entry, occ_next_use), a power of two

# slot, int64 [T, C, NUM_SLOT]: the cells of each trainer's cache slot.
SLOT_KEY = 0  # -1: free
SLOT_ENTRY = 1
SLOT_NEXT = 2  # the pair's PAIR_HEAD, kept here too for the victim scan
SLOT_STAMP = 3  # the last iteration that used or filled the slot
NUM_SLOT = 4

# entry, int64 [E, NUM_ENTRY]: a key's own cells.
ENTRY_KEY = 0
ENTRY_COPIES = 1
ENTRY_LAST_USE = 2  # the last iteration planned that used the key
ENTRY_LAST_WB = 3  # the version of its last planned write-back, -1 none
ENTRY_DROP = 4  # 3 cells, LEFT_*: the residency's first rule-3 leaver
ENTRY_VIC = 7  # 3 cells, LEFT_*: the residency's lowest capacity victim
NUM_ENTRY = 10

# entry_pair, int64 [E, T, NUM_PAIR]: per trainer, the (key, trainer) pair's cells.
PAIR_HEAD = 0  # the iteration of its earliest unplanned use, NEVER if none
PAIR_TAIL = 1  # its latest occurrence read, -1 if none is unplanned
PAIR_SLOT = 2  # the trainer's copy of the key, -1 if none
NUM_PAIR = 3

# Offsets from ENTRY_DROP and ENTRY_VIC. Both are stamped with the x being planned: rule-3
# leavers leave after x, victims after x-1.
LEFT_ITERATION = 0
LEFT_TRAINER = 1
LEFT_SLOT = 2

# victims, int64 [T, C, NUM_VICTIM]: per trainer, a max-heap of its capacity victims at x.
VICTIM_SLOT = 0
VICTIM_NEXT = 1  # the copy's next use, NEVER past the window
VICTIM_KEY = 2
NUM_VICTIM = 3

# victims_info, int64 [T, 2]
VICTIMS_BUILT_AT = 0  # the iteration the heap was built for; stale at any other
VICTIMS_LEFT = 1  # candidates left in it

# IntMap.cells, int64 [cap, 2]: a key and its value side by side, one cache line a probe.
CELL_KEY = 0  # -1: empty
CELL_VALUE = 1
# EngineState.index values: an entry (>= 0), or, for a key without one, -2 - the version of
# its last write-back (so -1: never written back).

# Event rows (Events.fetch, join_*, leave_*, write_*; `Planned` in oracle/rules.py).
EV_TRAINER = 0
EV_KEY = 1
EV_SLOT = 2
EV_MIN_VERSION = 3  # fetch rows only
EV_TARGET = 4  # appended by oracle/planner.py when it files a fetch
EV_FLUSH = 3  # write rows: appended by oracle/planner.py, 1 for a checkpoint flush

# Events.counts, int64 [NUM_COUNTS]: rows filled in each event buffer.
N_FETCH = 0
N_JOIN_DST = 1
N_JOIN_SRC = 2
N_GROUPS = 3  # group_keys and group_slots
N_LEAVE_PREV = 4
N_LEAVE_NOW = 5
N_WRITE_PREV = 6
N_WRITE_NOW = 7
N_FLUSH_PREV = 8
NUM_COUNTS = 9

# Events.stats, int64 [T, NUM_STATS]: per trainer, for the iteration planned.
STAT_USES = 0
STAT_HITS = 1  # uses served by a copy resident before the iteration's fetches
STAT_FETCHED = 2  # uses whose row is fetched for this iteration
STAT_JOINED = 3
STAT_OCCUPANCY = 4  # slots held during the iteration
NUM_STATS = 5

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


# --------------------------------------------------------------------------- hash maps
class IntMap(NamedTuple):
    """Hash map from non-negative int64 keys to int64 values, in one array: open addressing
    with linear probing, no deletion. Keep it at most half full (`reserve`)."""

    cells: np.ndarray  # int64 [cap, 2]: CELL_*; cap a power of two
    size: np.ndarray  # int64 [1]: keys held


KEEP_ALL = -2  # `rehashed` forgets no version: none is older than -1

# Fibonacci hashing: the golden ratio times the key spreads runs of keys over the table.
_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as an int64


def new_map(capacity: int) -> IntMap:
    """An empty map with room for `capacity` // 2 keys (`capacity` a power of two)."""
    cells = np.empty((capacity, 2), np.int64)
    cells[:, CELL_KEY] = -1
    return IntMap(cells=cells, size=np.zeros(1, np.int64))


def reserve_index(m: IntMap, more: int, forget_through: int) -> IntMap:
    """The planner's index `m`, or a copy of it, with room for `more` further keys. A copy
    leaves out the keys that only hold a write-back version <= `forget_through` (no fetch
    will ask for it: `PlannerConfig.landed_through`), and is larger than `m` only where what
    it keeps would fill more than a quarter of it: so the index grows with the keys in the
    window and the versions still needed, not with the keys of the run."""
    capacity = m.cells.shape[0]
    if 2 * (int(m.size[0]) + more) <= capacity:
        return m
    kept = index_kept(m.cells, forget_through)
    while capacity < 4 * (kept + more):
        capacity *= 2
    cells = rehashed(m.cells, capacity, forget_through)
    return IntMap(cells=cells, size=np.array([kept], np.int64))


@inlined
def _forgotten(value: int, forget_through: int) -> bool:
    """Whether an index cell's value is a write-back version <= forget_through."""
    return value < 0 and -2 - value <= forget_through


@kernel
def index_kept(cells: np.ndarray, forget_through: int) -> int:
    kept = 0
    for i in range(cells.shape[0]):
        if cells[i, CELL_KEY] >= 0 and not _forgotten(cells[i, CELL_VALUE], forget_through):
            kept += 1
    return kept


@kernel
def rehashed(cells: np.ndarray, capacity: int, forget_through: int) -> np.ndarray:
    """The keys and values of map cells, in new cells of `capacity` (a power of two), less
    the planner index's versions <= `forget_through` (`KEEP_ALL`: none)."""
    out = np.empty((capacity, 2), np.int64)
    for i in range(capacity):
        out[i, CELL_KEY] = -1
    for i in range(cells.shape[0]):
        if cells[i, CELL_KEY] >= 0 and not _forgotten(cells[i, CELL_VALUE], forget_through):
            c = map_find(out, cells[i, CELL_KEY])
            out[c, CELL_KEY] = cells[i, CELL_KEY]
            out[c, CELL_VALUE] = cells[i, CELL_VALUE]
    return out


@inlined
def map_find(cells: np.ndarray, key: int) -> int:
    """The cell of `key` in a map's cells, or the empty cell where it would go."""
    mask = cells.shape[0] - 1
    h = key * _MIX
    i = (h ^ (h >> 32)) & mask
    while cells[i, CELL_KEY] != key and cells[i, CELL_KEY] >= 0:
        i = (i + 1) & mask
    return i


@intrinsic
def _prefetch(typingctx: Any, array: types.Array, row: types.Integer) -> tuple[Any, Any]:
    """Start loading `array[row]` (its first cache line) into the cache, so that the loop
    that reaches it a few keys later does not wait on memory (planning is bound by that
    wait). numba has no prefetch of its own: this is LLVM's (`llvm.prefetch`, LLVM 15+)."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: tuple) -> Any:
        rows = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        offset = builder.mul(index, builder.extract_value(rows.strides, 0))
        byte = ir.IntType(8).as_pointer()
        start = cgutils.pointer_add(builder, builder.bitcast(rows.data, byte), offset)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
            "llvm.prefetch.p0",
        )
        # for writing (the loops update the rows), keep in all levels, data cache
        builder.call(fn, [start, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, row), codegen


# --------------------------------------------------------------------------- batches
@kernel
def read_pairs(keys: np.ndarray, num_trainers: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (key, trainer) pairs of a global batch int64 [B, F], ascending (pair id
    key * T + trainer, sample i on trainer i // (B/T)), and the index of every input's pair
    (int32 [B * F]). Hashing, then sorting the distinct pairs only: np.unique would sort every
    input, and a batch has several inputs per pair."""
    number, pair_of = _number_pairs(keys, num_trainers)
    order = _radix_order(pair_of)
    rank = np.empty(order.size, np.int32)
    for r in range(order.size):
        rank[order[r]] = r
    inverse = np.empty(number.size, np.int32)
    for i in range(number.size):
        inverse[i] = rank[number[i]]
    return pair_of[order], inverse


@kernel
def _number_pairs(keys: np.ndarray, num_trainers: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch's pairs numbered in order of first appearance: the number of every input
    (flat), and the pair of every number. One table per trainer, since trainers share no
    pair: a smaller table stays in cache."""
    b, f = keys.shape
    per = b // num_trainers
    number = np.empty(b * f, np.int32)
    pair_of = np.empty(b * f, np.int64)
    n = 0
    for j in range(num_trainers):
        cells = rehashed(np.empty((0, 2), np.int64), 1 << 12, KEEP_ALL)  # empty; grows with the pairs
        held = 0
        for i in range(j * per, (j + 1) * per):
            for c in range(f):
                p = keys[i, c] * num_trainers + j
                cell = map_find(cells, p)
                if cells[cell, CELL_KEY] < 0:
                    if 2 * (held + 1) > cells.shape[0]:
                        cells = rehashed(cells, 2 * cells.shape[0], KEEP_ALL)
                        cell = map_find(cells, p)
                    cells[cell, CELL_KEY] = p
                    cells[cell, CELL_VALUE] = n
                    pair_of[n] = p
                    n += 1
                    held += 1
                number[i * f + c] = cells[cell, CELL_VALUE]
    return number, pair_of[:n]


@kernel
def _radix_order(values: np.ndarray) -> np.ndarray:
    """The order that sorts non-negative `values`: LSD radix sort, 11 bits a pass (about
    five times np.argsort's speed on a batch's pairs)."""
    n = values.size
    order = np.arange(n)
    spare = np.empty(n, np.int64)
    top = values.max() if n else 0
    shift = 0
    while shift < 63 and (shift == 0 or top >> shift > 0):
        starts = np.zeros(2049, np.int64)
        for i in range(n):
            starts[((values[i] >> shift) & 2047) + 1] += 1
        for d in range(2048):
            starts[d + 1] += starts[d]
        for i in range(n):
            o = order[i]
            d = (values[o] >> shift) & 2047
            spare[starts[d]] = o
            starts[d] += 1
        order, spare = spare, order
        shift += 11
    return order


# --------------------------------------------------------------------------- state
class EngineState(NamedTuple):
    """Mutable planner state, all arrays (see the module docstring)."""

    slot: np.ndarray  # int64 [T, C, NUM_SLOT]: SLOT_*
    heap: np.ndarray  # int32 [T, C] min-heaps of free slots
    heap_size: np.ndarray  # int64 [T]
    victims: np.ndarray  # int64 [T, C, NUM_VICTIM]: VICTIM_*
    victims_info: np.ndarray  # int64 [T, 2]: VICTIMS_*
    index: IntMap  # key -> entry, or its last write-back (see CELL_VALUE)
    entry: np.ndarray  # int64 [E, NUM_ENTRY]: ENTRY_*
    entry_pair: np.ndarray  # int64 [E, T, NUM_PAIR]: PAIR_*
    entry_free: np.ndarray  # int64 [E] stack of freed entries
    counters: np.ndarray  # int64 [3]: FREED_ENTRIES, USED_ENTRIES, RING_SIZE
    occ_entry: np.ndarray  # int64 [ring] entry of occurrence id % ring
    occ_next_use: np.ndarray  # int64 [ring] iteration of the pair's next occurrence, NEVER none yet


def new_state(num_trainers: int, capacity: int, ring: int, entries: int) -> EngineState:
    """Empty caches: every slot free; room for `entries` keys in the window (memory that is
    only touched as keys come) and `ring` occurrences (a power of two); an index with room
    for the keys of full caches."""
    t, c = num_trainers, capacity
    slot = np.empty((t, c, NUM_SLOT), np.int64)
    slot[:, :, SLOT_KEY] = slot[:, :, SLOT_ENTRY] = slot[:, :, SLOT_STAMP] = -1
    slot[:, :, SLOT_NEXT] = NEVER
    return EngineState(
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


def reserve_entries(state: EngineState, more: int, forget_through: int) -> EngineState:
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


def grow_ring(state: EngineState, live_from: int, live_to: int, ring: int) -> EngineState:
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
    """Event buffers of one planned iteration; column meaning per buffer in `plan_iteration`."""

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


# --------------------------------------------------------------------------- free slots
@inlined
def _heap_push(heap: np.ndarray, size: np.ndarray, j: int, slot: int) -> None:
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
def _heap_pop(heap: np.ndarray, size: np.ndarray, j: int) -> int:
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


# --------------------------------------------------------------------------- ingest
@kernel
def ingest(st: EngineState, z: int, pairs: np.ndarray, base: int, num_trainers: int) -> None:
    """Read batch z: its sorted unique pairs get occurrence ids base, base+1, ...

    Links each pair's previous occurrence to this one and, where the pair had no unplanned
    occurrence, tells the pair's copy (if any) that its next use is now known: z.
    """
    occ_entry, occ_next_use, entry = st.occ_entry, st.occ_next_use, st.entry
    entry_pair, slot = st.entry_pair, st.slot
    cells, freed, counters = st.index.cells, st.entry_free, st.counters
    mask = counters[RING_SIZE] - 1
    new_keys = 0
    e = -1
    last_key = -1
    for i in range(pairs.shape[0]):
        key = pairs[i] // num_trainers
        j = pairs[i] % num_trainers
        if key != last_key:  # the key's entry, a new one if it has none
            last_key = key
            c = map_find(cells, key)
            known = cells[c, CELL_KEY] >= 0
            e = cells[c, CELL_VALUE] if known else -1
            if e < 0:
                new_keys += not known
                if counters[FREED_ENTRIES] > 0:
                    counters[FREED_ENTRIES] -= 1
                    e = freed[counters[FREED_ENTRIES]]
                else:
                    e = counters[USED_ENTRIES]
                    counters[USED_ENTRIES] += 1
                _new_entry(cells, c, key, e, entry, entry_pair)
        o = base + i
        occ_entry[o & mask] = e
        occ_next_use[o & mask] = NEVER
        prev = entry_pair[e, j, PAIR_TAIL]
        entry_pair[e, j, PAIR_TAIL] = o
        if prev >= 0:
            occ_next_use[prev & mask] = z
        else:  # no unplanned occurrence of the pair so far
            entry_pair[e, j, PAIR_HEAD] = z
            s = entry_pair[e, j, PAIR_SLOT]
            if s >= 0:
                slot[j, s, SLOT_NEXT] = z
    st.index.size[0] += new_keys


@inlined
def _new_entry(
    cells: np.ndarray, c: int, key: int, e: int, entry: np.ndarray, entry_pair: np.ndarray
) -> None:
    """Entry e for `key` (index cell c): no copies, no occurrences, the last write-back kept
    in the cell if it has one."""
    last_wb = -2 - cells[c, CELL_VALUE] if cells[c, CELL_KEY] >= 0 else -1
    cells[c, CELL_KEY] = key
    cells[c, CELL_VALUE] = e
    entry[e, ENTRY_KEY] = key
    entry[e, ENTRY_COPIES] = 0
    entry[e, ENTRY_LAST_USE] = -1
    entry[e, ENTRY_LAST_WB] = last_wb
    for t in range(entry_pair.shape[1]):
        entry_pair[e, t, PAIR_HEAD] = NEVER
        entry_pair[e, t, PAIR_TAIL] = -1
        entry_pair[e, t, PAIR_SLOT] = -1


@kernel
def _free_entries(st: EngineState, done: np.ndarray, n: int) -> None:
    """Keys without copies or unplanned occurrences: their index cells keep only the version
    of their last write-back."""
    cells, entry, freed, counters = st.index.cells, st.entry, st.entry_free, st.counters
    for i in range(n):
        e = done[i]
        cells[map_find(cells, entry[e, ENTRY_KEY]), CELL_VALUE] = -2 - entry[e, ENTRY_LAST_WB]
        freed[counters[FREED_ENTRIES]] = e
        counters[FREED_ENTRIES] += 1


# --------------------------------------------------------------------------- copies
@inlined
def _add_copy(
    entry: np.ndarray, entry_pair: np.ndarray, slot: np.ndarray, e: int, j: int, s: int, x: int
) -> None:
    entry_pair[e, j, PAIR_SLOT] = s
    entry[e, ENTRY_COPIES] += 1
    slot[j, s, SLOT_KEY] = entry[e, ENTRY_KEY]
    slot[j, s, SLOT_ENTRY] = e
    slot[j, s, SLOT_NEXT] = entry_pair[e, j, PAIR_HEAD]
    slot[j, s, SLOT_STAMP] = x


@inlined
def _remove_copy(
    entry: np.ndarray,
    entry_pair: np.ndarray,
    slot: np.ndarray,
    heap: np.ndarray,
    heap_size: np.ndarray,
    e: int,
    j: int,
    s: int,
) -> None:
    """The copy leaves; its slot is free (callers decide from which iteration on)."""
    entry_pair[e, j, PAIR_SLOT] = -1
    entry[e, ENTRY_COPIES] -= 1
    slot[j, s, SLOT_KEY] = -1
    slot[j, s, SLOT_ENTRY] = -1
    _heap_push(heap, heap_size, j, s)


@inlined
def _holder(entry_pair: np.ndarray, e: int) -> int:
    """The lowest-index trainer with a copy of the entry's key, or -1."""
    for t in range(entry_pair.shape[1]):
        if entry_pair[e, t, PAIR_SLOT] >= 0:
            return t
    return -1


@inlined
def _left(entry: np.ndarray, e: int, which: int, x: int, j: int, s: int) -> None:
    """Stamp the ENTRY_DROP or ENTRY_VIC cells of entry e."""
    entry[e, which + LEFT_ITERATION] = x
    entry[e, which + LEFT_TRAINER] = j
    entry[e, which + LEFT_SLOT] = s


@inlined
def _emit(
    buf: np.ndarray, counts: np.ndarray, which: int, trainer: int, key: int, slot: int
) -> None:
    n = counts[which]
    buf[n, EV_TRAINER] = trainer
    buf[n, EV_KEY] = key
    buf[n, EV_SLOT] = slot
    counts[which] = n + 1


@inlined
def _fetch(
    fetch: np.ndarray, counts: np.ndarray, entry: np.ndarray, j: int, e: int, s: int
) -> None:
    n = counts[N_FETCH]
    fetch[n, EV_TRAINER] = j
    fetch[n, EV_KEY] = entry[e, ENTRY_KEY]
    fetch[n, EV_SLOT] = s
    fetch[n, EV_MIN_VERSION] = entry[e, ENTRY_LAST_WB]
    counts[N_FETCH] = n + 1


# --------------------------------------------------------------------------- victims
@inlined
def _top_victim(
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
def _pop_victim(heaps: np.ndarray, info: np.ndarray, j: int) -> int:
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


@inlined
def _evict(
    entry: np.ndarray,
    entry_pair: np.ndarray,
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
    _emit(leave_prev, counts, N_LEAVE_PREV, j, slot[j, s, SLOT_KEY], s)
    _remove_copy(entry, entry_pair, slot, heap, heap_size, e, j, s)
    if entry[e, ENTRY_VIC + LEFT_ITERATION] != x:
        ended[ended[VIC_COUNT] + 1] = e
        ended[VIC_COUNT] += 1
        _left(entry, e, ENTRY_VIC, x, j, s)
    elif j < entry[e, ENTRY_VIC + LEFT_TRAINER]:
        _left(entry, e, ENTRY_VIC, x, j, s)


# --------------------------------------------------------------------------- planning
# How far ahead the per-key loops prefetch entries: far enough for memory to answer, near
# enough for the rows to still be in cache (measured on the bench stream).
_AHEAD_PAIRS = 24
_AHEAD_KEYS = 8


@kernel
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
    horizon = x + lookahead
    # a. classify keys
    groups = np.empty((pairs.shape[0] + 1, NUM_GROUP), np.int64)
    need = np.zeros(num_trainers, np.int64)
    n_groups = _classify(st, ev, x, pairs, base, groups, need)
    groups = groups[: n_groups + 1]
    flush_rows = _flush_candidates(st, flush, flush_after)
    # b. mandatory victims, then slots for the new copies in key order
    ended = np.empty(ev.fetch.shape[0] + 1, np.int64)
    ended[VIC_COUNT] = 0
    _evict_for(st, ev, x, horizon, need, ended)
    _assign_new(st, ev, x, pairs, groups)
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
    n_done = _after_use(st, ev, x, pairs, base, horizon, groups, done)
    _free_entries(st, done, n_done)


@kernel
def _classify(
    st: EngineState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    base: int,
    groups: np.ndarray,
    need: np.ndarray,
) -> int:
    """Rules 1-2: per key, its entry and the lowest-index holder at the end of x-1 with its
    slot (the join source, read before any victim leaves), or -1: admitted. Fills `groups`
    and each trainer's `need` of new copies; returns the number of keys."""
    occ_entry, entry_pair, slot = st.occ_entry, st.entry_pair, st.slot
    pair_slot, stats = ev.pair_slot, ev.stats
    t_count = slot.shape[0]
    mask = st.counters[RING_SIZE] - 1
    n_groups = 0
    e = -1
    last_key = -1
    for i in range(pairs.shape[0]):
        key = pairs[i] // t_count
        j = pairs[i] % t_count
        if i + _AHEAD_PAIRS < pairs.shape[0]:
            _prefetch(entry_pair, occ_entry[(base + i + _AHEAD_PAIRS) & mask])
        if key != last_key:
            last_key = key
            e = occ_entry[(base + i) & mask]
            holder = _holder(entry_pair, e)
            groups[n_groups, GROUP_START] = i
            groups[n_groups, GROUP_ENTRY] = e
            groups[n_groups, GROUP_SRC] = holder
            if holder >= 0:
                groups[n_groups, GROUP_SRC_SLOT] = entry_pair[e, holder, PAIR_SLOT]
            n_groups += 1
        stats[j, STAT_USES] += 1
        s = entry_pair[e, j, PAIR_SLOT]
        if s >= 0:
            pair_slot[i] = s
            slot[j, s, SLOT_STAMP] = x
            stats[j, STAT_HITS] += 1
        else:
            need[j] += 1
    groups[n_groups, GROUP_START] = pairs.shape[0]
    return n_groups


@kernel
def _flush_candidates(st: EngineState, flush: bool, flush_after: int) -> np.ndarray:
    """Rows [entry, trainer, key, slot]: residencies at the end of x-1 used after
    `flush_after`, with their lowest-index copy as writer."""
    slot, entry, entry_pair = st.slot, st.entry, st.entry_pair
    t_count, capacity = slot.shape[0], slot.shape[1]
    if not flush:
        return np.empty((0, 4), np.int64)
    out = np.empty((t_count * capacity, 4), np.int64)
    n = 0
    for j in range(t_count):
        for s in range(capacity):
            e = slot[j, s, SLOT_ENTRY]
            if e < 0 or entry[e, ENTRY_LAST_USE] <= flush_after or _holder(entry_pair, e) != j:
                continue
            out[n, FLUSH_ENTRY] = e
            out[n, FLUSH_TRAINER] = j
            out[n, FLUSH_KEY] = entry[e, ENTRY_KEY]
            out[n, FLUSH_SLOT] = s
            n += 1
    return out[:n]


@kernel
def _evict_for(
    st: EngineState, ev: Events, x: int, horizon: int, need: np.ndarray, ended: np.ndarray
) -> None:
    """Rule 4: each trainer evicts until its `need` new copies at x fit."""
    entry, entry_pair, slot, heap = st.entry, st.entry_pair, st.slot, st.heap
    heap_size = st.heap_size
    heaps, info, leave_prev, counts = st.victims, st.victims_info, ev.leave_prev, ev.counts
    for j in range(need.shape[0]):
        for _ in range(need[j] - heap_size[j]):
            _top_victim(slot, heaps, info, j, x, horizon)  # builds the heap on the first call
            s = _pop_victim(heaps, info, j)
            _evict(entry, entry_pair, slot, heap, heap_size, leave_prev, counts, ended, j, s, x)


@kernel
def _assign_new(st: EngineState, ev: Events, x: int, pairs: np.ndarray, groups: np.ndarray) -> None:
    """Rule 5 for the mandatory new copies (fetches and joins), in key order."""
    entry, entry_pair, slot, heap = st.entry, st.entry_pair, st.slot, st.heap
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
            s = _heap_pop(heap, heap_size, j)
            if not admitted and not joined:
                _emit(join_src, counts, N_JOIN_SRC, src, key, groups[g, GROUP_SRC_SLOT])
                joined = True
            _add_copy(entry, entry_pair, slot, e, j, s, x)
            pair_slot[i] = s
            if admitted:
                _fetch(fetch, counts, entry, j, e, s)
                stats[j, STAT_FETCHED] += 1
            else:
                _emit(join_dst, counts, N_JOIN_DST, j, key, s)
                stats[j, STAT_JOINED] += 1


@kernel
def _prefetch_later(
    st: EngineState, ev: Events, x: int, horizon: int, groups: np.ndarray, ended: np.ndarray
) -> None:
    """Rule 1: a trainer using an admitted key at u in (x, x+L] fetches it now if it has a
    free slot or a victim whose next use is strictly later than u."""
    entry, entry_pair, slot, heap = st.entry, st.entry_pair, st.slot, st.heap
    heap_size = st.heap_size
    heaps, info, fetch, leave_prev = st.victims, st.victims_info, ev.fetch, ev.leave_prev
    counts = ev.counts
    for g in range(groups.shape[0] - 1):
        if groups[g, GROUP_SRC] >= 0:
            continue
        e = groups[g, GROUP_ENTRY]
        for j in range(slot.shape[0]):
            # heads are not advanced yet: a trainer using the key at x has u == x
            u = entry_pair[e, j, PAIR_HEAD]
            if u <= x or u > horizon:
                continue
            if heap_size[j] == 0:
                if (
                    _top_victim(slot, heaps, info, j, x, horizon) < 0
                    or heaps[j, 0, VICTIM_NEXT] <= u
                ):
                    continue
                s = _pop_victim(heaps, info, j)
                _evict(entry, entry_pair, slot, heap, heap_size, leave_prev, counts, ended, j, s, x)
            s = _heap_pop(heap, heap_size, j)
            _add_copy(entry, entry_pair, slot, e, j, s, x)
            _fetch(fetch, counts, entry, j, e, s)


@kernel
def _end_victims(st: EngineState, ev: Events, x: int, ended: np.ndarray) -> None:
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
        _emit(write_prev, counts, N_WRITE_PREV, writer, entry[e, ENTRY_KEY], s)
        entry[e, ENTRY_LAST_WB] = x - 1


@kernel
def _flush(st: EngineState, ev: Events, rows: np.ndarray) -> None:
    """Checkpoint flushes (`_flush_candidates`) of the residencies still going: apart from
    the writes that end residencies, since the writer's own copy may be leaving too."""
    entry, flush_prev, counts = st.entry, ev.flush_prev, ev.counts
    for i in range(rows.shape[0]):
        j, key, s = rows[i, FLUSH_TRAINER], rows[i, FLUSH_KEY], rows[i, FLUSH_SLOT]
        if entry[rows[i, FLUSH_ENTRY], ENTRY_COPIES] > 0:
            _emit(flush_prev, counts, N_FLUSH_PREV, j, key, s)


@kernel
def _after_use(
    st: EngineState,
    ev: Events,
    x: int,
    pairs: np.ndarray,
    base: int,
    horizon: int,
    groups: np.ndarray,
    done: np.ndarray,
) -> int:
    """Per key used at x, while its cells are in cache (no key's steps read another key's
    cells): rule 6, G_x; its pairs move to their next occurrences; rule 3, which copies leave
    after x. Returns how many keys are done (no copies, no unplanned use), listed in `done`."""
    occ_next_use, entry, entry_pair, slot = st.occ_next_use, st.entry, st.entry_pair, st.slot
    heap, heap_size = st.heap, st.heap_size
    pair_slot, group_keys, group_slots = ev.pair_slot, ev.group_keys, ev.group_slots
    leave_now, write_now, counts = ev.leave_now, ev.write_now, ev.counts
    t_count = slot.shape[0]
    mask = st.counters[RING_SIZE] - 1
    n_done = 0
    for g in range(groups.shape[0] - 1):
        if g + _AHEAD_KEYS < groups.shape[0] - 1:
            _prefetch(entry, groups[g + _AHEAD_KEYS, GROUP_ENTRY])
            _prefetch(entry_pair, groups[g + _AHEAD_KEYS, GROUP_ENTRY])
        e = groups[g, GROUP_ENTRY]
        key = entry[e, ENTRY_KEY]
        if entry[e, ENTRY_COPIES] >= 2:
            _group(group_keys, group_slots, counts, entry, entry_pair, e)
        for i in range(groups[g, GROUP_START], groups[g + 1, GROUP_START]):
            j = pairs[i] % t_count
            nxt = occ_next_use[(base + i) & mask]
            entry_pair[e, j, PAIR_HEAD] = nxt
            if nxt == NEVER:  # this was also the latest occurrence read
                entry_pair[e, j, PAIR_TAIL] = -1
            slot[j, pair_slot[i], SLOT_NEXT] = nxt
        keeper = _keeper(entry_pair, e, horizon)
        first = -1
        for t in range(t_count):
            s = entry_pair[e, t, PAIR_SLOT]
            if s < 0 or t == keeper or entry_pair[e, t, PAIR_HEAD] <= horizon:
                continue
            _emit(leave_now, counts, N_LEAVE_NOW, t, key, s)
            _remove_copy(entry, entry_pair, slot, heap, heap_size, e, t, s)
            if first < 0:
                first = t
                _left(entry, e, ENTRY_DROP, x, t, s)
        entry[e, ENTRY_LAST_USE] = x
        if entry[e, ENTRY_COPIES] == 0:  # the residency ends: its first leaver writes
            _emit(write_now, counts, N_WRITE_NOW, first, key, entry[e, ENTRY_DROP + LEFT_SLOT])
            entry[e, ENTRY_LAST_WB] = x
            if not _unplanned_use(entry_pair, e):
                done[n_done] = e
                n_done += 1
    return n_done


@inlined
def _group(
    group_keys: np.ndarray,
    group_slots: np.ndarray,
    counts: np.ndarray,
    entry: np.ndarray,
    entry_pair: np.ndarray,
    e: int,
) -> None:
    """Add the entry's key to G_x, with every trainer's slot."""
    n = counts[N_GROUPS]
    group_keys[n] = entry[e, ENTRY_KEY]
    for t in range(group_slots.shape[1]):
        group_slots[n, t] = entry_pair[e, t, PAIR_SLOT]
    counts[N_GROUPS] = n + 1


@inlined
def _keeper(entry_pair: np.ndarray, e: int, horizon: int) -> int:
    """Rule 3's keeper after the use: if no copy has a use by its own trainer in the window
    but some trainer uses the key there, the lowest-index copy's trainer; else -1."""
    holder = -1
    used_later = False
    for t in range(entry_pair.shape[1]):
        in_window = entry_pair[e, t, PAIR_HEAD] <= horizon
        if entry_pair[e, t, PAIR_SLOT] >= 0:
            if in_window:
                return -1
            if holder < 0:
                holder = t
        used_later |= in_window
    return holder if used_later else -1


@inlined
def _unplanned_use(entry_pair: np.ndarray, e: int) -> bool:
    for t in range(entry_pair.shape[1]):
        if entry_pair[e, t, PAIR_TAIL] >= 0:
            return True
    return False
