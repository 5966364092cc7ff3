"""Column and cell names of the planner's state and event arrays (`state`), and NEVER.

Module-level ints are compile-time constants to numba, so naming an index costs nothing. A
kernel compiles them into its code, and numba's cache alone would not see an edit here:
the kernels' cache folder does (`cache`). The other oracle modules import them from here.
"""

from __future__ import annotations

import numpy as np

NEVER = np.int64(1 << 62)  # the iteration of a use that is not read yet, or not at all

# counters, int64 [NUM_COUNTERS]: the state's scalars, in an array so that kernels can change
# them.
FREED_ENTRIES = 0  # entries on the entry_free stack, handed out again first
RING_SIZE = 1  # entries of the occurrence ring (occ_entry, occ_next_use), a power of two
POOL_USED = 2  # rows of the store ever handed out (entries and blocks): the rest is untouched
POOL_CLASSES = 3  # a bit set: bit c is set while pool_free[c] holds a block
NUM_COUNTERS = 4

# slot, int64 [T, C, NUM_SLOT]: the cells of each trainer's cache slot.
SLOT_KEY = 0  # -1: free
SLOT_ENTRY = 1
SLOT_NEXT = 2  # its record's REC_HEAD, kept here too for the victim scan
SLOT_STAMP = 3  # the last iteration that used or filled the slot
NUM_SLOT = 4

# pool, int64 [R, NUM_REC]: the store's rows, half a cache line each. A key's *records*, one
# per trainer that holds a copy of it or has an unplanned use of it, ascending by trainer,
# are rows of its entry's home or of a block (`records`). A trainer without a record is one
# with no copy and no unplanned use: NEVER, -1, -1 below.
REC_TRAINER = 0
REC_HEAD = 1  # the iteration of the pair's earliest unplanned use, NEVER if none
REC_TAIL = 2  # its latest occurrence read, -1 if none is unplanned
REC_SLOT = 3  # the trainer's copy of the key, -1 if none
NUM_REC = 4
REC_NEXT_FREE = 0  # a free block's first row: the next free block of its size, -1 none

# entry, int64 [R / ENTRY_ROWS, NUM_ENTRY]: the same store seen as entries of ENTRY_ROWS rows,
# three cache lines: a key's cells that every step reads, then its *home*, room for
# HOME_RECORDS records (so that a key used by one or two trainers has its records in the
# line after its cells: no second lookup), then the cells of copies leaving.
ENTRY_KEY = 0
ENTRY_COPIES = 1
ENTRY_BLOCK = 2  # the pool row of its first record: its home, or a block
ENTRY_RECORDS = 3  # its records, in pool rows [ENTRY_BLOCK, ENTRY_BLOCK + ENTRY_RECORDS)
ENTRY_CLASS = 4  # its block has 2 ** ENTRY_CLASS rows; HOME_CLASS: its records are at home
ENTRY_LAST_USE = 5  # the last iteration planned that used the key
ENTRY_LAST_WB = 6  # the version of its last planned write-back, -1 none
ENTRY_DROP = 16  # 3 cells, LEFT_*: the residency's first rule-3 leaver
ENTRY_VIC = 19  # 3 cells, LEFT_*: the residency's lowest capacity victim
ENTRY_ROWS = 6
HOME_ROW = 2  # entry e's home is pool rows ENTRY_ROWS * e + HOME_ROW ...
HOME_RECORDS = 2
HOME_CLASS = -1
NUM_ENTRY = ENTRY_ROWS * NUM_REC
ENTRY_LINES = 3  # cache lines: the cells, the home, the leavers'

# pool_free, int64 [NUM_CLASSES]: per size class c (blocks of 2 ** c rows), the first free
# block, -1 none. Blocks hold more than HOME_RECORDS records, and a key at most
# T <= 2 ** 12 (oracle.config.MAX_TRAINERS).
NUM_CLASSES = 13

# Offsets from ENTRY_DROP and ENTRY_VIC. Both are stamped with the x being planned: rule-3
# leavers leave after x, victims after x-1.
LEFT_ITERATION = 0
LEFT_TRAINER = 1
LEFT_SLOT = 2

# victims, int64 [T, C, NUM_VICTIM]: per trainer, its capacity victims at x in VICTIM_BUCKETS
# buckets by next use (`heaps`), the one being taken from a max-heap.
VICTIM_SLOT = 0
VICTIM_NEXT = 1  # the copy's next use, NEVER past the window
VICTIM_KEY = 2
NUM_VICTIM = 3
VICTIM_BUCKETS = 256

# victim_starts, int64 [T, VICTIM_BUCKETS + 1]: where each bucket of a trainer's victims starts.

# victims_info, int64 [T, NUM_VICTIMS_INFO]
VICTIMS_BUILT_AT = 0  # the iteration the victims were counted for; stale at any other
VICTIMS_BUCKET = 1  # the bucket being taken from
VICTIMS_LO = 2  # its heap: rows [VICTIMS_LO, VICTIMS_HI) of the trainer's victims,
VICTIMS_HI = 3  # empty once every bucket is taken
VICTIMS_FILLED = 4  # buckets [0, VICTIMS_FILLED) are in the victims array; later ones only counted
NUM_VICTIMS_INFO = 5

# victim_bucket, int16 [T, C]: per trainer and slot, the bucket of its copy as a victim at
# VICTIMS_BUILT_AT, VICTIM_BUCKETS if it is none (free, or used then).

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
