"""The sans-IO oracle planner (docs/design.md#the-planner, #modes): global batches in, final directives out.

Feed global batches in order with `push`; each call returns the directives that became final,
as a list over iterations of per-trainer lists. Iteration x is planned once batch x+L is read;
directive e is final once e + max(D, 1) is planned (its prefetches target up to e+D, its
leaves include victims chosen while planning e+1, its sync split needs the uses of e+1). So the
oracle reads L + max(D, 1) batches ahead of what it sends. `finish` plans the rest; every
residency then ends with a write-back, so the PS holds every final row.

The output depends only on the batches: pushing the stream one batch at a time or all at once
gives byte-identical directives.

Iterations are counted from 0 inside the planner and its rules; `_directives` turns them into
global numbers (`PlannerConfig.first_iteration`) in the one place directives are assembled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.arrays import in_sorted, sorted_unique
from common.directive import Directive
from common.spec import Mode
from oracle.bagpipe import BagpipeRules
from oracle.config import (
    PlannerConfig,
    capacity_bound,
    check_batch_size,
    hottest_keys,
    required_capacity,
)
from oracle.kernels.layout import (
    EV_FLUSH,
    EV_KEY,
    EV_MIN_VERSION,
    EV_SLOT,
    EV_TARGET,
    EV_TRAINER,
    STAT_FETCHED,
    STAT_HITS,
    STAT_OCCUPANCY,
    STAT_USES,
)
from oracle.kernels.parts import rows_by_group, split_groups
from oracle.modes import LocalRules, StaticRules
from oracle.parts import IterationParts, assemble
from oracle.rules import Batch, Planned, Rules
from oracle.stats import IterationStats, PlannerStats

if TYPE_CHECKING:
    from oracle.workers import ProcessPool

#: The kernels every mode's planner calls besides its rules' (`oracle.compiled`).
KERNELS = (rows_by_group, split_groups)

__all__ = [
    "Directive",
    "Planner",
    "PlannerConfig",
    "PlannerStats",
    "capacity_bound",
    "hottest_keys",
    "required_capacity",
]


@dataclass
class _Pending:
    """Events filed under one iteration's directives until they are final."""

    batch: Batch
    pair_slot: np.ndarray | None = None
    fetch: list[np.ndarray] = field(default_factory=list)  # EV_TRAINER ... EV_TARGET
    join_dst: list[np.ndarray] = field(default_factory=list)
    join_src: list[np.ndarray] = field(default_factory=list)
    leave: list[np.ndarray] = field(default_factory=list)
    write: list[np.ndarray] = field(default_factory=list)  # EV_TRAINER, EV_KEY, EV_SLOT, 0
    flush: list[np.ndarray] = field(default_factory=list)  # the same, 1: checkpoint flushes
    group_keys: np.ndarray | None = None
    group_slots: np.ndarray | None = None
    stats: np.ndarray | None = None


class Planner:
    """One planner per run; not thread-safe (the service calls it from one task).

    With `config.workers` = P > 1 it plans in P worker processes, one key partition each
    (oracle/workers.py), which start with it and end with `finish` (or `close`, or when it
    is collected). `push` then returns the directives that were final one batch earlier:
    the workers plan batch z while this process merges what batch z - 1 made final.
    Concatenated, the output is the same as when each batch's directives come with it.
    Given a `pool` (`oracle.workers.ProcessPool`, whose planners have finished), it plans
    in those processes instead, and leaves them running at `finish`: the segments of a
    stream (oracle/live.py) share one pool.
    """

    def __init__(self, config: PlannerConfig, *, pool: ProcessPool | None = None) -> None:
        self.config = config
        self.stats = PlannerStats(num_trainers=config.num_trainers)
        self._parallel = None
        if config.workers > 1:
            from oracle.workers import ParallelPlanner, ProcessPool  # imports this module

            if pool is None:
                self._parallel = ParallelPlanner(config, ProcessPool(config), self.stats)
            else:
                pool.restart(config)
                self._parallel = ParallelPlanner(config, pool, self.stats, owns_pool=False)
            return
        self._lead = config.effective_lead
        self._rules: Rules = rules_class(config.mode)(config)
        self._pending: dict[int, _Pending] = {}
        self._read = 0  # batches read
        self._planned = 0  # iterations planned
        self._emitted = 0  # iterations whose directives were returned
        self._shape: tuple[int, int] | None = None
        self._finished = False

    def push(self, keys: np.ndarray) -> list[list[Directive]]:
        """Read the next global batch: int64 ``[B, F]`` keys, sample i on trainer i // (B/T)."""
        if self._parallel is not None:
            return self._parallel.push(keys)
        return self._assembled(self.push_parts(keys))

    def push_parts(self, keys: np.ndarray) -> list[IterationParts]:
        """`push`, the directives left as parts (what a worker of a key partition sends)."""
        if self._finished:
            raise RuntimeError("push after finish")
        batch = self._read_batch(keys)
        z = self._read
        self._pending[z] = _Pending(batch=batch)
        self._rules.ingest(z, batch)
        self._read += 1
        while self._planned + self.config.effective_lookahead < self._read:
            self._plan_next()
        return self._emit_parts(self._planned - max(self._lead, 1))

    @property
    def keys_held(self) -> int:
        """Keys the planner keeps state for: in the window, cached, or with a write-back
        version a fetch may still need (and, in bagpipe mode, versions left for the index's
        next rehash to forget). Bounded by the window and the caches, not the run."""
        if self._parallel is not None:
            return self._parallel.keys_held
        return self._rules.keys_held

    @property
    def worker_cpu_s(self) -> float:
        """CPU seconds the planner's worker processes have spent planning (P > 1; 0 at
        P = 1, where this process plans); as of the last batch's directives returned."""
        return self._parallel.worker_cpu_s if self._parallel is not None else 0.0

    def finish(self) -> list[list[Directive]]:
        """End of stream: plan and return everything left."""
        if self._parallel is not None:
            return self._parallel.finish()
        return self._assembled(self.finish_parts())

    def close(self) -> None:
        """Stop the worker processes, if any, without planning further (`finish` does too)."""
        if self._parallel is not None:
            self._parallel.close()

    def finish_parts(self) -> list[IterationParts]:
        """`finish`, the directives left as parts."""
        return [parts for made in self.finishing() for parts in made]

    def finishing(self) -> Iterator[list[IterationParts]]:
        """`finish_parts` one planned iteration at a time: what each made final (a worker
        sends them on while it plans the next)."""
        if self._finished:
            return
        self._finished = True
        while self._planned < self._read:
            self._plan_next()
            if self._planned < self._read:  # the last one's directives wait for `close`
                yield self._emit_parts(self._planned - max(self._lead, 1))
        if self._read:
            closing = self._rules.close(self._read - 1)
            if closing is not None:
                self._pending[self._read - 1].leave.append(closing.leave_now)
                self._pending[self._read - 1].write.append(_flagged(closing.write_now, 0))
        yield self._emit_parts(self._read)

    # ----------------------------------------------------------------- internals
    def _read_batch(self, keys: np.ndarray) -> Batch:
        keys = checked_keys(self.config, keys, self._shape)
        self._shape = keys.shape
        return Batch.read(keys, self.config.num_trainers, self.config.partition)

    def _plan_next(self) -> None:
        x = self._planned
        self._file(x, self._rules.plan(x, self._pending[x].batch))
        self._planned += 1

    def _file(self, x: int, planned: Planned) -> None:
        """File the events of planning x under the directives they belong to."""
        here = self._pending[x]
        here.pair_slot = planned.pair_slot
        here.group_keys, here.group_slots = planned.group_keys, planned.group_slots
        here.stats = planned.stats
        target = np.full((planned.fetch.shape[0], 1), x, np.int64)
        self._pending[max(0, x - self._lead)].fetch.append(np.hstack([planned.fetch, target]))
        here.join_dst.append(planned.join_dst)
        here.join_src.append(planned.join_src)
        here.leave.append(planned.leave_now)
        here.write.append(_flagged(planned.write_now, 0))
        if x > 0:
            self._pending[x - 1].leave.append(planned.leave_prev)
            self._pending[x - 1].write.append(_flagged(planned.write_prev, 0))
            self._pending[x - 1].write.append(_flagged(planned.flush_prev, 1))

    def _assembled(self, final: list[IterationParts]) -> list[list[Directive]]:
        out = []
        for parts in final:
            out.append(assemble(parts))
            self.stats.add(parts.stats)
        return out

    def _emit_parts(self, upto: int) -> list[IterationParts]:
        out = []
        while self._emitted < upto:
            e = self._emitted
            nxt = self._pending[e + 1].batch.used_keys if e + 1 < self._read else np.zeros(0, np.int64)
            out.append(self._parts(e, self._pending.pop(e), nxt))
            self._emitted += 1
        return out

    def _parts(self, e: int, p: _Pending, next_keys: np.ndarray) -> IterationParts:
        """Directive e of every trainer, from the events filed under it; a key partition's
        with its slots moved into its share of the cache."""
        cfg = self.config
        t, first = cfg.num_trainers, cfg.first_iteration
        g = first + e  # the global iteration of local e
        assert p.pair_slot is not None and p.group_keys is not None and p.group_slots is not None
        # each event list sorted once, then cut per trainer: [at[j], at[j + 1]) is trainer j's
        fetch, fetch_at = _by_trainer(_cat(p.fetch, 5), t, by_target=True)
        leave, leave_at = _by_trainer(_cat(p.leave, 3), t)
        write, write_at = _by_trainer(_cat(p.write, 4), t)
        join_dst = _cat(p.join_dst, 3)
        join_keys, send, recv = _joins(_cat(p.join_src, 3), join_dst, t)
        now = in_sorted(p.group_keys, next_keys)
        later = ~now
        now_slots, later_slots = split_groups(p.group_slots, now)  # int32 [T, n] each
        inputs = np.take(p.pair_slot, p.batch.inverse)
        off = cfg.partition.offset if cfg.partition is not None else 0
        return IterationParts(
            iteration=g,
            checkpoint=cfg.is_checkpoint(g),
            input_slots=inputs.reshape(p.batch.shape) if p.batch.positions is None else None,
            input_positions=p.batch.positions,
            input_values=_moved(inputs, off) if p.batch.positions is not None else None,
            fetch_keys=fetch[:, EV_KEY].copy(),
            fetch_slots=_moved(fetch[:, EV_SLOT].astype(np.int32), off),
            fetch_min_versions=_min_versions(fetch[:, EV_MIN_VERSION], cfg.landed_through(e), first),
            fetch_targets=(fetch[:, EV_TARGET] + first).astype(np.int32),
            fetch_at=fetch_at,
            leave_keys=leave[:, EV_KEY].copy(),
            leave_slots=_moved(leave[:, EV_SLOT].astype(np.int32), off),
            leave_at=leave_at,
            write_keys=write[:, EV_KEY].copy(),
            write_slots=_moved(write[:, EV_SLOT].astype(np.int32), off),
            write_flush=write[:, EV_FLUSH].astype(np.uint8),
            write_at=write_at,
            join_keys=join_keys,
            join_send=_moved(send, off),
            join_recv=_moved(recv, off),
            now_keys=p.group_keys[now],
            now_slots=_moved(now_slots, off),
            later_keys=p.group_keys[later],
            later_slots=_moved(later_slots, off),
            stats=_iteration_stats(g, p, fetch, join_dst, write, now),
        )


def checked_keys(config: PlannerConfig, keys: np.ndarray, shape: tuple[int, int] | None) -> np.ndarray:
    """A global batch as int64, C-contiguous; `shape` that of the batches so far, if any.

    Keys come from the data through the table layout, never from a spec: a malformed batch
    is the caller's bug (ValueError); a batch size that does not split is a spec error
    (ConfigError from `check_batch_size`)."""
    keys = np.asarray(keys)
    if keys.ndim != 2 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"keys must be a 2-d integer array, got {keys.dtype} {keys.shape}")
    if shape is not None and keys.shape != shape:
        raise ValueError(f"batch shape {keys.shape} differs from {shape}")
    check_batch_size(config, keys.shape[0])
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if keys.size and keys.min() < 0:
        raise ValueError("keys must be non-negative")
    if config.mode == "local" and keys.size and keys.max() >= config.total_rows:
        raise ValueError(f"key {int(keys.max())} >= total_rows {config.total_rows}")
    return keys


def rules_class(mode: Mode) -> type[BagpipeRules | StaticRules | LocalRules]:
    """The planning rules of `mode` (docs/design.md#modes)."""
    if mode == "bagpipe":
        return BagpipeRules
    if mode == "local":
        return LocalRules
    return StaticRules


def _min_versions(versions: np.ndarray, landed: int, first: int) -> np.ndarray:
    """A directive's fetch versions, local, as global min_versions: -1 for none since the
    planner started and for those `landed` (`PlannerConfig.landed_through`)."""
    return np.where(versions > max(landed, -1), versions + first, -1)


def _moved(slots: np.ndarray, offset: int) -> np.ndarray:
    """Slots of a key partition's share of the cache, as slots of the whole (-1 stays)."""
    if offset == 0:
        return slots
    return np.where(slots >= 0, slots + offset, slots).astype(slots.dtype, copy=False)


def _flagged(writes: np.ndarray, flush: int) -> np.ndarray:
    """Write events with their EV_FLUSH column: 1 for checkpoint flushes, 0 for residency ends."""
    return np.column_stack([writes, np.full(writes.shape[0], flush, np.int64)])


def _cat(parts: list[np.ndarray], width: int) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, width), np.int64)


def _by_trainer(
    events: np.ndarray, num_trainers: int, by_target: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The rows ordered by trainer, then key (by trainer, target, key if `by_target`), and
    where each trainer's rows start. One stable sort of the keys (the events come in a few
    runs already ordered by key, which timsort merges in linear time), then a counting sort
    by trainer (`rows_by_group`), rather than a mask and a sort per trainer."""
    by_key = np.argsort(events[:, EV_KEY], kind="stable")
    return rows_by_group(events, by_key, EV_TRAINER, EV_TARGET if by_target else -1, num_trainers)


def _joins(
    src: np.ndarray, dst: np.ndarray, num_trainers: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The keys joined (ascending), and per trainer and key the slot it sends and the slot it
    receives into, or -1: int32 [T, keys] each."""
    keys = sorted_unique(dst[:, EV_KEY])
    send = np.full((num_trainers, keys.size), -1, np.int32)
    recv = np.full((num_trainers, keys.size), -1, np.int32)
    send[src[:, EV_TRAINER], np.searchsorted(keys, src[:, EV_KEY])] = src[:, EV_SLOT]
    recv[dst[:, EV_TRAINER], np.searchsorted(keys, dst[:, EV_KEY])] = dst[:, EV_SLOT]
    return keys, send, recv


def _iteration_stats(
    e: int, p: _Pending, fetch: np.ndarray, join_dst: np.ndarray, write: np.ndarray, now: np.ndarray
) -> IterationStats:
    assert p.stats is not None
    return IterationStats(
        iteration=e,
        uses=int(p.stats[:, STAT_USES].sum()),
        hits=int(p.stats[:, STAT_HITS].sum()),
        fetched=int(p.stats[:, STAT_FETCHED].sum()),
        prefetched=int(fetch.shape[0]),
        joined=int(join_dst.shape[0]),
        written=int(write.shape[0]),
        sync_now=int(np.count_nonzero(now)),
        sync_later=int(now.size - np.count_nonzero(now)),
        occupancy=tuple(int(v) for v in p.stats[:, STAT_OCCUPANCY]),
    )
