"""The planning rules of each mode behind one interface, and what planning one iteration yields.

`Planned` is the event list of one planned iteration x; `oracle/planner.py` files each event in
the directive it belongs to. Rows of the event arrays are (trainer, key, slot[, extra]); their
columns and those of `stats` are named in oracle/kernels/layout.py (EV_*, STAT_*).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from oracle.config import KeyPartition, PlannerConfig, infeasible_capacity
from oracle.kernels.batch import read_pairs, read_partition_pairs


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One global batch of keys ``int64 [B, F]`` (`shape`), read into its (key, trainer) pairs.

    A pair id is ``key * T + trainer``; `pairs` is sorted and unique, so pairs come in key
    order, then trainer order. ``pairs[inverse]`` is the pair of every input, or, read for
    a key partition, of the inputs at the flat `positions` (those of its keys). The batch
    keeps no reference to the keys it was read from: the window holds L batches.
    """

    shape: tuple[int, int]
    pairs: np.ndarray
    inverse: np.ndarray
    used_keys: np.ndarray
    positions: np.ndarray | None = None  # int32: None, every input

    @classmethod
    def read(cls, keys: np.ndarray, num_trainers: int, partition: KeyPartition | None = None) -> Batch:
        """`keys` int64, C-contiguous; only those of `partition` if given."""
        positions = None
        if partition is None:
            pairs, inverse = read_pairs(keys, num_trainers)
        else:
            pairs, inverse, positions = read_partition_pairs(keys, num_trainers, partition.index, partition.count)
        used = pairs // num_trainers
        used_keys = used[np.concatenate(([True], used[1:] != used[:-1]))] if used.size else used
        return cls(shape=keys.shape, pairs=pairs, inverse=inverse, used_keys=used_keys, positions=positions)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """Events of planning iteration x."""

    pair_slot: np.ndarray  # int32 [P]: slot of each pair during x
    fetch: np.ndarray  # int64 [n, 4]: trainer, key, slot, min_version; target x
    join_dst: np.ndarray  # int64 [n, 3]
    join_src: np.ndarray  # int64 [n, 3]
    leave_prev: np.ndarray  # int64 [n, 3]: leave after x-1
    leave_now: np.ndarray  # int64 [n, 3]: leave after x
    write_prev: np.ndarray  # int64 [n, 3]: write version x-1, ending a residency
    write_now: np.ndarray  # int64 [n, 3]: write version x, ending a residency
    flush_prev: np.ndarray  # int64 [n, 3]: write version x-1, checkpoint x-1's flush
    group_keys: np.ndarray  # int64 [G]: G_x
    group_slots: np.ndarray  # int32 [G, T]
    stats: np.ndarray  # int64 [T, 5]: uses, hits, fetched for use, joined, occupancy


class Rules(Protocol):
    """One mode's planning rules, fed batches in order. `kernels` are the numba functions
    they call (each compiles its callees with it; oracle/compiled.py compiles them ahead)."""

    kernels: ClassVar[tuple[Callable[..., Any], ...]]

    def ingest(self, z: int, batch: Batch) -> None:
        """Batch z has been read (batches arrive in order)."""

    def plan(self, x: int, batch: Batch) -> Planned:
        """Plan iteration x; called once batch x + L is read, or at the end of the stream."""

    def close(self, last: int) -> Planned | None:
        """The stream ended after iteration `last`: events of `last` still to add, if any."""

    @property
    def keys_held(self) -> int:
        """Keys the rules keep state for: what their memory grows with."""


def rows(n: int, width: int) -> np.ndarray:
    return np.zeros((n, width), np.int64)


def check_feasible(config: PlannerConfig, x: int, need: np.ndarray) -> None:
    """ConfigError naming the first trainer whose `need` (rows at x) exceeds C (rule 4)."""
    if need.size and need.max() > config.capacity:
        j = int(np.argmax(need))
        raise infeasible_capacity(x, j, int(need[j]), config.capacity, config.partition)
