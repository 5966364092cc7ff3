"""The baselines of docs/design.md#modes as `Rules`, vectorised with numpy.

* `StaticRules` (`static-cache`, and `no-cache` = no pinned rows): the pinned hot rows live in
  slots 0..H-1 of every trainer from iteration 0 to the end; every other row a trainer uses
  at x is fetched for x (L = D = 0) into slots H, H+1, ... in key order and leaves after x,
  written back by the lowest-index trainer that used it.
* `LocalRules` (`local`): every trainer holds the whole table, slot = key, no PS traffic.

Both keep §4 rule 6 for the sync lists: G_x = keys used at x with at least two copies.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.typed import Dict

from oracle.config import PlannerConfig
from oracle.kernels.batch import read_pairs
from oracle.kernels.layout import NUM_STATS, STAT_FETCHED, STAT_HITS, STAT_OCCUPANCY, STAT_USES
from oracle.rules import Batch, Planned, check_feasible, rows


@nb.njit(cache=True)
def _lookup(table: Dict, key: int) -> int:
    """table[key], or -1 if absent (`+ 0` turns get's Optional into a plain int64)."""
    return table.get(key, -1) + 0


@nb.njit(cache=True)
def _swap_versions(last_wb: Dict, keys: np.ndarray, version: int) -> np.ndarray:
    """Each key's last write-back version (-1 if none), then record `version` for all."""
    out = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        out[i] = _lookup(last_wb, keys[i])
        last_wb[keys[i]] = version
    return out


@nb.njit(cache=True)
def _forget_versions(last_wb: Dict, through: int) -> None:
    """Remove the keys whose last write-back version is <= `through`."""
    old = [key for key, version in last_wb.items() if version <= through]
    for key in old:
        del last_wb[key]


class StaticRules:
    """Pinned hot rows plus synchronous fetches of the rest (FAE-style)."""

    kernels = (read_pairs, _swap_versions, _forget_versions)

    def __init__(self, config: PlannerConfig) -> None:
        self._config = config
        self._hot = config.hot_keys
        self._hot_last_use = np.full(self._hot.size, -1, np.int64)
        # versions of recent write-backs: those landed (`PlannerConfig.landed_through`) are
        # dropped every `write_lag` iterations, so it holds the keys of about 2 W iterations
        self._last_wb = Dict.empty(types.int64, types.int64)

    def ingest(self, z: int, batch: Batch) -> None:
        """Nothing to remember ahead: L = 0."""

    @property
    def keys_held(self) -> int:
        return len(self._last_wb)

    def plan(self, x: int, batch: Batch) -> Planned:
        t = self._config.num_trainers
        hot, h = self._hot, self._hot.size
        keys, trainers = batch.pairs // t, batch.pairs % t
        pos = np.searchsorted(hot, keys)
        is_hot = pos < h
        is_hot[is_hot] = hot[pos[is_hot]] == keys[is_hot]
        cold = np.flatnonzero(~is_hot)
        cold_per = np.bincount(trainers[cold], minlength=t)
        check_feasible(self._config, x, h + cold_per)
        slot = pos.astype(np.int32)
        slot[cold] = h + _rank_within(trainers[cold], cold_per)
        cold_rows = np.stack([trainers[cold], keys[cold], slot[cold]], axis=1)
        firsts = _first_of_runs(keys[cold])  # pairs are in key, then trainer order
        if x % self._config.write_lag == 0:
            _forget_versions(self._last_wb, self._config.landed_through(x))
        versions = _swap_versions(self._last_wb, keys[cold[firsts]], x)
        min_v = np.repeat(versions, np.diff(np.append(firsts, cold.size)))
        fill = self._hot_fill() if x == 0 else rows(0, 4)
        fetch = np.concatenate([fill, np.column_stack([cold_rows, min_v])])
        flush = self._flush(x - 1) if x > 0 and self._config.is_local_checkpoint(x - 1) else rows(0, 3)
        self._hot_last_use[pos[is_hot]] = x
        group_keys, group_slots = self._groups(batch, is_hot, slot)
        stats = np.zeros((t, NUM_STATS), np.int64)
        stats[:, STAT_USES] = np.bincount(trainers, minlength=t)
        stats[:, STAT_HITS] = 0 if x == 0 else np.bincount(trainers[is_hot], minlength=t)
        hot_fetched = np.bincount(trainers[is_hot], minlength=t) if x == 0 else 0
        stats[:, STAT_FETCHED] = cold_per + hot_fetched
        stats[:, STAT_OCCUPANCY] = h + cold_per
        return Planned(
            pair_slot=slot,
            fetch=fetch,
            join_dst=rows(0, 3),
            join_src=rows(0, 3),
            leave_prev=rows(0, 3),
            leave_now=cold_rows,
            write_prev=rows(0, 3),
            write_now=cold_rows[firsts],
            flush_prev=flush,
            group_keys=group_keys,
            group_slots=group_slots,
            stats=stats,
        )

    def close(self, last: int) -> Planned | None:
        """The pinned rows leave every trainer after the last iteration; trainer 0 writes them."""
        t, h = self._config.num_trainers, self._hot.size
        every = np.stack(
            [np.repeat(np.arange(t), h), np.tile(self._hot, t), np.tile(np.arange(h), t)], axis=1
        )
        empty = rows(0, 3)
        return Planned(
            pair_slot=np.zeros(0, np.int32),
            fetch=rows(0, 4),
            join_dst=empty,
            join_src=empty,
            leave_prev=empty,
            leave_now=every,
            write_prev=empty,
            write_now=every[:h],
            flush_prev=empty,
            group_keys=np.zeros(0, np.int64),
            group_slots=np.zeros((0, t), np.int32),
            stats=np.zeros((t, NUM_STATS), np.int64),
        )

    def _hot_fill(self) -> np.ndarray:
        """Iteration 0 fetches every pinned row into every trainer (never written before)."""
        t, h = self._config.num_trainers, self._hot.size
        return np.stack(
            [np.repeat(np.arange(t), h), np.tile(self._hot, t), np.tile(np.arange(h), t), np.full(t * h, -1)],
            axis=1,
        )

    def _flush(self, c: int) -> np.ndarray:
        """Checkpoint c: trainer 0 writes the pinned rows used since the previous checkpoint."""
        dirty = np.flatnonzero(self._hot_last_use > c - self._config.checkpoint_every)
        return np.stack([np.zeros(dirty.size, np.int64), self._hot[dirty], dirty], axis=1)

    def _groups(self, batch: Batch, is_hot: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """G_x: pinned keys used at x (T copies) and other keys used by two trainers or more."""
        t = self._config.num_trainers
        keys, trainers = batch.pairs // t, batch.pairs % t
        starts = _first_of_runs(keys)
        flags = np.zeros(keys.size, np.int64)
        flags[starts] = 1
        group_of = np.cumsum(flags) - 1
        copies = np.where(is_hot[starts], t, np.diff(np.append(starts, keys.size)))
        chosen = copies >= 2
        table = np.full((starts.size, t), -1, np.int32)
        table[group_of, trainers] = slot
        table[is_hot[starts]] = slot[starts][is_hot[starts], None]
        return keys[starts][chosen], table[chosen]


class LocalRules:
    """Full tables in every trainer: slot = key; only the sync lists are planned."""

    kernels = (read_pairs,)

    def __init__(self, config: PlannerConfig) -> None:
        self._config = config

    def ingest(self, z: int, batch: Batch) -> None:
        """Nothing to remember ahead."""

    @property
    def keys_held(self) -> int:
        return 0

    def plan(self, x: int, batch: Batch) -> Planned:
        t = self._config.num_trainers
        keys, trainers = batch.pairs // t, batch.pairs % t
        groups = batch.used_keys if t > 1 else np.zeros(0, np.int64)
        stats = np.zeros((t, NUM_STATS), np.int64)
        stats[:, STAT_USES] = stats[:, STAT_HITS] = np.bincount(trainers, minlength=t)
        stats[:, STAT_OCCUPANCY] = self._config.total_rows
        empty = rows(0, 3)
        return Planned(
            pair_slot=keys.astype(np.int32),
            fetch=rows(0, 4),
            join_dst=empty,
            join_src=empty,
            leave_prev=empty,
            leave_now=empty,
            write_prev=empty,
            write_now=empty,
            flush_prev=empty,
            group_keys=groups,
            group_slots=np.repeat(groups.astype(np.int32)[:, None], t, axis=1),
            stats=stats,
        )

    def close(self, last: int) -> Planned | None:
        return None


def _first_of_runs(sorted_values: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values starts."""
    if sorted_values.size == 0:
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.concatenate(([True], sorted_values[1:] != sorted_values[:-1])))


def _rank_within(groups: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Position of each element among the earlier elements of its group (input order)."""
    order = np.argsort(groups, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.empty(groups.size, np.int64)
    rank[order] = np.arange(groups.size) - starts[groups[order]]
    return rank
