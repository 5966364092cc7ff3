"""Bagpipe mode: the numba kernels (oracle/kernels/) behind the `Rules` interface."""

from __future__ import annotations

import numpy as np

from oracle.config import PlannerConfig
from oracle.kernels.batch import read_pairs, read_partition_pairs
from oracle.kernels.ingest import ingest
from oracle.kernels.intmap import index_kept, rehashed
from oracle.kernels.layout import (
    N_FETCH,
    N_GROUPS,
    N_JOIN_DST,
    N_JOIN_SRC,
    N_LEAVE_NOW,
    N_LEAVE_PREV,
    N_FLUSH_PREV,
    N_WRITE_NOW,
    N_WRITE_PREV,
    RING_SIZE,
)
from oracle.kernels.merge import merge_runs
from oracle.kernels.plan import plan_iteration
from oracle.kernels.state import Events, grow_ring, grow_store, new_state, pow2, reserve_keys, reuse_events
from oracle.rules import Batch, Planned, check_feasible

_MIN_RING = 1 << 16


class BagpipeRules:
    """The planner (docs/design.md#the-planner) with lookahead L and lead D, one kernel state for all trainers."""

    # read_partition_pairs and merge_runs: what planning with workers adds (oracle/workers.py)
    kernels = (read_pairs, ingest, plan_iteration, rehashed, index_kept, read_partition_pairs, merge_runs)

    def __init__(self, config: PlannerConfig) -> None:
        self._config = config
        # room for every key resident and three times as many more in the window, in memory
        # touched only as keys come; the window's keys and pairs grow it beyond that
        entries = 4 * config.num_trainers * config.capacity
        self._state = new_state(config.num_trainers, config.capacity, _MIN_RING, entries)
        self._base: dict[int, int] = {}  # first occurrence id of each unplanned batch
        self._next_id = 0
        self._planned = 0  # iterations planned
        self._events: Events | None = None  # the event buffers, reused by every iteration

    def ingest(self, z: int, batch: Batch) -> None:
        live_from = min(self._base.values(), default=self._next_id)
        live_to = self._next_id + batch.pairs.size
        if live_to - live_from > int(self._state.counters[RING_SIZE]):
            ring = max(pow2(2 * (live_to - live_from)), _MIN_RING)
            self._state = grow_ring(self._state, live_from, self._next_id, ring)
        # a key read from now on is fetched by directive max(0, x - D) or later, x the next planned
        first_directive = max(0, self._planned - self._config.prefetch_lead)
        forget_through = self._config.landed_through(first_directive)
        self._state = reserve_keys(self._state, batch.used_keys.size, forget_through)
        self._base[z] = self._next_id
        t, read = self._config.num_trainers, 0
        while True:  # it stops early only where the store has no room left
            read = ingest(self._state, z, batch.pairs, batch.used_keys, self._next_id, t, read)
            if read == batch.used_keys.size:
                break
            self._state = grow_store(self._state)
        self._next_id = live_to

    @property
    def keys_held(self) -> int:
        return int(self._state.index.size[0])

    def plan(self, x: int, batch: Batch) -> Planned:
        cfg = self._config
        t = cfg.num_trainers
        check_feasible(cfg, x, np.bincount(batch.pairs % t, minlength=t))
        flush = x > 0 and cfg.is_local_checkpoint(x - 1)
        flush_rows = t * cfg.capacity if flush else 0  # one per resident key at most
        ev = self._events = reuse_events(
            self._events, batch.pairs.size, batch.used_keys.size, t, cfg.capacity, flush_rows
        )
        base = self._base.pop(x)
        self._planned = x + 1
        plan_iteration(
            self._state, ev, x, batch.pairs, base, t, cfg.lookahead, flush, x - 1 - cfg.checkpoint_every
        )
        n = ev.counts
        # copies: the buffers are the next iteration's (`reuse_events`); the events are few
        return Planned(
            pair_slot=ev.pair_slot,
            fetch=ev.fetch[: n[N_FETCH]].copy(),
            join_dst=ev.join_dst[: n[N_JOIN_DST]].copy(),
            join_src=ev.join_src[: n[N_JOIN_SRC]].copy(),
            group_keys=ev.group_keys[: n[N_GROUPS]].copy(),
            group_slots=ev.group_slots[: n[N_GROUPS]].copy(),
            leave_prev=ev.leave_prev[: n[N_LEAVE_PREV]].copy(),
            leave_now=ev.leave_now[: n[N_LEAVE_NOW]].copy(),
            write_prev=ev.write_prev[: n[N_WRITE_PREV]].copy(),
            write_now=ev.write_now[: n[N_WRITE_NOW]].copy(),
            flush_prev=ev.flush_prev[: n[N_FLUSH_PREV]].copy(),
            stats=ev.stats.copy(),
        )

    def close(self, last: int) -> Planned | None:
        # every copy leaves at its last use once the window runs past the stream's end
        return None
