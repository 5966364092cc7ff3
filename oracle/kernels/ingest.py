"""Reading batch z into the planner's window (`ingest`): every key gets an entry, every
(key, trainer) pair an occurrence.

Every (key, trainer) *pair* read but not yet planned is an occurrence in a ring that knows
its key's entry and, once the pair is read again, that next occurrence's iteration. The
entry holds each pair's latest occurrence (``tail``), so reading a batch links each pair,
and planning moves each pair's head (oracle/kernels/plan.py), without a hash lookup per
pair.
"""

from __future__ import annotations

import numpy as np

from oracle.kernels.intmap import CELL_KEY, CELL_VALUE, map_find
from oracle.kernels.jit import inlined, kernel
from oracle.kernels.layout import (
    ENTRY_COPIES,
    ENTRY_KEY,
    ENTRY_LAST_USE,
    ENTRY_LAST_WB,
    FREED_ENTRIES,
    NEVER,
    PAIR_HEAD,
    PAIR_SLOT,
    PAIR_TAIL,
    RING_SIZE,
    SLOT_NEXT,
    USED_ENTRIES,
)
from oracle.kernels.state import BagpipeState


@kernel
def ingest(st: BagpipeState, z: int, pairs: np.ndarray, base: int, num_trainers: int) -> None:
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
