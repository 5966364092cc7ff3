"""Planner configuration and the capacity checks the oracle runs before training starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from common.arrays import sorted_unique
from common.checkpoints import is_checkpoint
from common.directive import WRITE_LAG, landed_through
from common.errors import ConfigError
from common.spec import MODES, Mode
from oracle.kernels.batch import key_partitions

#: Pair ids are ``key * T + trainer`` in int64; this bound keeps them exact.
MAX_TRAINERS = 1 << 12
#: Planner worker processes (`oracle.planner_workers`): more than cores only costs.
MAX_WORKERS = 256


@dataclass(frozen=True, kw_only=True)
class KeyPartition:
    """One worker's share of a planner split `count` ways (docs/design.md#parallel-planning):
    the keys whose hash falls in partition `index` (`oracle.kernels.batch.key_partition`),
    planned in slots [offset, offset + share) of every trainer's cache of C = `capacity`
    slots. The shares cut C into `count` runs differing by one slot at most."""

    index: int
    count: int
    capacity: int  # C of the whole planner

    @property
    def offset(self) -> int:
        return self.index * self.capacity // self.count

    @property
    def share(self) -> int:
        return (self.index + 1) * self.capacity // self.count - self.offset


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What the planner needs to know (docs/design.md#the-planner, #modes, #checkpoints).

    `lookahead` (L) and `prefetch_lead` (D) matter in `bagpipe` mode only: `no-cache` and
    `static-cache` plan with L = D = 0 for the rows they do not pin. `capacity` (C, rows per
    trainer) is ignored in `local` mode, where the cache is the whole table of `total_rows`
    rows and slot = key. `hot_keys` is the static cache's pinned set (see `hottest_keys`);
    it is pinned in slots 0..H-1 of every trainer in key order. `checkpoint_every` = n > 0
    marks iterations n-1, 2n-1, ... as checkpoints.

    `first_iteration` (F) is the global number of the first batch pushed: a run resumed from
    checkpoint c plans with F = c + 1 (docs/design.md#resuming-every-role). The planner counts its own iterations from
    0 internally; its directives carry global numbers (iteration, prefetch targets, write
    versions, min_versions >= 0 all shifted by F) and mark checkpoints by global number, so
    a resumed run marks and flushes the same checkpoints as an uninterrupted one. A
    min_version of -1 still means "not written back since the planner started", or not
    since `landed_through` the fetch's directive.

    `write_lag` (W) is the trainers' write-back lag (`common.directive.WRITE_LAG`); a
    trainer must not run with a larger one. Tests make it small so that the rule acts in
    short streams.

    `workers` (P, `oracle.planner_workers`, bagpipe mode only) splits the keys among P
    processes, each planning its keys in its share of every trainer's cache
    (`KeyPartition`); their directives are merged. `partition` is set in the config of one
    such worker (`for_partition`), whose `capacity` is then its share.
    """

    num_trainers: int
    lookahead: int
    prefetch_lead: int
    capacity: int
    mode: Mode = "bagpipe"
    checkpoint_every: int = 0
    first_iteration: int = 0
    total_rows: int = 0
    write_lag: int = WRITE_LAG
    workers: int = 1
    partition: KeyPartition | None = None
    hot_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), compare=False)

    def __post_init__(self) -> None:
        # Errors name the spec field (or command-line option) each parameter comes from.
        _positive_int("trainers.count", self.num_trainers)
        if self.num_trainers > MAX_TRAINERS:
            raise ConfigError("trainers.count", f"at most {MAX_TRAINERS} trainers")
        _non_negative_int("oracle.lookahead", self.lookahead)
        _non_negative_int("oracle.prefetch_lead", self.prefetch_lead)
        _non_negative_int("checkpoint.every", self.checkpoint_every)
        _non_negative_int("--first-iteration", self.first_iteration)
        _positive_int("write_lag", self.write_lag)
        if type(self.total_rows) is not int or self.total_rows < 0:
            raise ConfigError(
                "data.table_sizes", f"total rows must be an integer >= 0, got {self.total_rows!r}"
            )
        if self.mode not in MODES:
            raise ConfigError("oracle.mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.mode == "local":
            if not 0 < self.total_rows <= np.iinfo(np.int32).max:
                raise ConfigError(
                    "data.table_sizes", f"local mode needs 0 < total rows < 2**31, got {self.total_rows}"
                )
        else:
            _positive_int("oracle.cache_rows", self.capacity)
            if self.capacity > np.iinfo(np.int32).max:
                raise ConfigError("oracle.cache_rows", "slots must fit in int32")
        self._check_workers()
        object.__setattr__(self, "hot_keys", self._checked_hot_keys())

    def _check_workers(self) -> None:
        _positive_int("oracle.planner_workers", self.workers)
        if self.workers > MAX_WORKERS:
            raise ConfigError("oracle.planner_workers", f"at most {MAX_WORKERS}, got {self.workers}")
        if self.workers > 1 and self.mode != "bagpipe":
            raise ConfigError(
                "oracle.planner_workers",
                f"only bagpipe mode plans in parallel; {self.mode!r} needs planner_workers = 1",
            )
        if self.workers > self.capacity:
            raise ConfigError(
                "oracle.cache_rows",
                f"C = {self.capacity} < oracle.planner_workers = {self.workers}: each worker "
                "needs a share of every trainer's cache",
            )
        if self.partition is not None and self.workers != 1:
            raise ValueError("a partition's config plans alone (workers = 1)")

    def for_partition(self, index: int) -> PlannerConfig:
        """The config of worker `index` of `workers`: its share of C."""
        part = KeyPartition(index=index, count=self.workers, capacity=self.capacity)
        return dataclasses.replace(self, capacity=part.share, workers=1, partition=part)

    def _checked_hot_keys(self) -> np.ndarray:
        hot = np.asarray(self.hot_keys)
        if hot.size and self.mode != "static-cache":
            raise ConfigError("oracle.mode", f"only static-cache pins hot keys, not {self.mode!r}")
        # The hot set is computed from the data (`hottest_keys`), never written in a spec: a
        # malformed one is the caller's bug, not a configuration error.
        if hot.ndim != 1 or (hot.size and not np.issubdtype(hot.dtype, np.integer)):
            raise ValueError("hot_keys must be a 1-d integer array")
        hot = np.asarray(hot, dtype=np.int64)
        if hot.size and (hot.min() < 0 or np.any(np.diff(hot) <= 0)):
            raise ValueError("hot_keys must be non-negative, ascending and unique")
        if self.mode == "static-cache" and hot.size > self.capacity:
            raise ConfigError("oracle.cache_rows", f"{hot.size} hot keys exceed C = {self.capacity}")
        hot = hot.copy()
        hot.flags.writeable = False
        return hot

    @property
    def effective_lookahead(self) -> int:
        return self.lookahead if self.mode == "bagpipe" else 0

    @property
    def effective_lead(self) -> int:
        return self.prefetch_lead if self.mode == "bagpipe" else 0

    def landed_through(self, x: int) -> int:
        """The newest version (local, like x) that directive x's fetches may ask for as -1."""
        return landed_through(x, self.write_lag)

    def is_checkpoint(self, iteration: int) -> bool:
        """Whether global iteration `iteration` is a checkpoint."""
        return is_checkpoint(iteration, self.checkpoint_every)

    def is_local_checkpoint(self, x: int) -> bool:
        """Whether the planner's own iteration x (counted from 0) is a checkpoint, judged by
        its global number first_iteration + x; for planning rules, which count from 0."""
        return self.is_checkpoint(self.first_iteration + x)


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(name, f"must be a non-negative integer, got {value!r}")


def infeasible_capacity(
    iteration: int, trainer: int, need: int, capacity: int, partition: KeyPartition | None = None
) -> ConfigError:
    """The capacity error (docs/design.md#rule-4-capacity): some trainer needs more than C rows
    at one iteration (with `partition`: more than the share of C of one worker, among that
    worker's keys; docs/design.md#parallel-planning)."""
    if partition is not None:
        p = partition
        return ConfigError(
            "oracle.cache_rows",
            f"C = {p.capacity} is infeasible with oracle.planner_workers = {p.count}: worker "
            f"{p.index} plans its keys in {p.share} slots of each trainer, and trainer {trainer} "
            f"uses {need} distinct rows of them at iteration {iteration}; C >= {p.count * need} "
            "needed",
        )
    return ConfigError(
        "oracle.cache_rows",
        f"C = {capacity} is infeasible: trainer {trainer} uses {need} distinct rows at iteration "
        f"{iteration}; C >= {need} needed",
    )


def capacity_bound(config: PlannerConfig, batch_size: int, num_features: int) -> int:
    """Rows a trainer may need in one iteration at worst: (B/T) x F, plus the pinned set."""
    per_trainer = check_batch_size(config, batch_size)
    return int(config.hot_keys.size) + per_trainer * num_features


def check_batch_size(config: PlannerConfig, batch_size: int) -> int:
    """Samples per trainer; ConfigError unless B is a positive multiple of T."""
    if batch_size <= 0 or batch_size % config.num_trainers:
        raise ConfigError(
            "train.batch_size",
            f"global batch {batch_size} is not a positive multiple of "
            f"trainers.count = {config.num_trainers}",
        )
    return batch_size // config.num_trainers


def required_capacity(config: PlannerConfig, batches: Iterable[np.ndarray]) -> int:
    """The smallest feasible C for a known stream: hot rows + max over x, j of |U_x[j] \\ hot|;
    with P = `config.workers`, P x the most rows one trainer uses at one iteration among the
    keys of one worker (C = P n gives every worker a share of n)."""
    need = 0
    hot = config.hot_keys
    workers = config.workers
    for batch in batches:
        per = check_batch_size(config, batch.shape[0])
        for j in range(config.num_trainers):
            used = sorted_unique(batch[j * per : (j + 1) * per])
            used = used[~np.isin(used, hot)]
            if workers > 1:
                need = max(need, int(np.bincount(key_partitions(used, workers), minlength=workers).max()))
            else:
                need = max(need, used.size)
    return int(hot.size) + workers * need


def hottest_keys(batches: Iterable[np.ndarray], count: int) -> np.ndarray:
    """The `count` most used keys of a stream (ties: smaller key first), ascending.

    One frequency pass; memory grows with the distinct keys seen, as any exact count must.
    """
    keys = np.zeros(0, np.int64)
    counts = np.zeros(0, np.int64)
    for batch in batches:
        k, c = np.unique(np.asarray(batch, dtype=np.int64), return_counts=True)
        merged, inverse = np.unique(np.concatenate([keys, k]), return_inverse=True)
        total = np.zeros(merged.size, np.int64)
        np.add.at(total, inverse, np.concatenate([counts, c]))
        keys, counts = merged, total
    order = np.lexsort((keys, -counts))[:count]
    return np.sort(keys[order])
