"""What the oracle builds from a job before it plans: its workload (the data read as global
batches), its planner's configuration, and the capacity check the launcher runs too."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from common.data.dataset import open_dataset
from common.data.live import LiveSource
from common.errors import ConfigError
from common.job import OPEN_END, Job
from common.spec import with_trainer_count
from oracle.config import PlannerConfig, capacity_bound, hottest_keys, required_capacity
from oracle.service import Workload
from oracle.stream import LiveWorkload, stream_folder

log = logging.getLogger(__name__)


def build_workload(job: Job, start: int = 0, *, until: int | None = None) -> Workload | LiveWorkload:
    """The batches the oracle plans: a data set's, or a live stream's (`data.watch`), which
    trains until `until` (``--until``) or `train.max_iterations`, the sooner, or until stopped."""
    train = job.spec.train
    if job.data.watch:
        source = LiveSource(job.data, stream_folder(job.spec.checkpoint.dir))
        ends = [n for n in (until, train.max_iterations) if n]
        return LiveWorkload(source=source, layout=job.layout, batch_size=train.batch_size,
                            until=min(ends) if ends else OPEN_END, start=start)
    if until is not None:
        raise ConfigError("--until", "only a stream (data.watch) is trained until an iteration given here: "
                          "set train.max_iterations")  # fmt: skip
    return Workload(
        dataset=open_dataset(job.data, progress=True),
        layout=job.layout,
        batch_size=train.batch_size,
        epochs=train.epochs,
        max_iterations=train.max_iterations,
        start=start,
    )


def planner_config(job: Job, workload: Workload, *, every_count: bool = True) -> PlannerConfig:
    """The planner's parameters from the spec; fails at start-up when C cannot work (for
    every trainer count an elastic job may have, unless not `every_count`: a regroup's)."""
    (check_capacity if every_count else check_trainer_capacity)(job)
    config = PlannerConfig(**_planner_fields(job, workload.start))
    if config.mode != "static-cache":
        return config
    # FAE-style: pin the hottest rows, keep room for one iteration's other rows.
    count = config.capacity - capacity_bound(config, workload.batch_size, job.layout.num_tables)
    hot = hottest_keys(_hot_set_batches(workload), count)
    log.info("static cache pins the %d hottest rows", len(hot))
    return dataclasses.replace(config, hot_keys=np.sort(hot))


def _hot_set_batches(workload: Workload | LiveWorkload) -> Iterator[np.ndarray]:
    """The batches a static cache's hot set is chosen from: the whole run's, also when
    resuming (the plan does not depend on where it starts); a stream's first part, the one
    part every start of the run has (`LiveWorkload.first_part_batches`)."""
    if isinstance(workload, LiveWorkload):
        yield from workload.first_part_batches()
        return
    yield from (keys for keys, _, _ in dataclasses.replace(workload, start=0).key_batches())


def check_capacity(job: Job) -> None:
    """`check_trainer_capacity` for the job's trainer count, and for an elastic job's every
    other count that divides the batch: a regroup must never find C too small."""
    trainers = job.spec.trainers
    counts = [trainers.count] + [t for t in range(trainers.min_count, trainers.max_count + 1)
                                 if t != trainers.count and job.spec.train.batch_size % t == 0]
    for count in counts:
        check_trainer_capacity(job if count == trainers.count else
                               dataclasses.replace(job, spec=with_trainer_count(job.spec, count)))


def check_trainer_capacity(job: Job) -> None:
    """The capacity rule (docs/design.md#rule-4-capacity, #modes): ConfigError naming `oracle.cache_rows` and
    the C this run needs. The launcher calls it before it starts any role, the oracle before
    it plans; it judges the whole run, also when resuming, so that both always agree.

    static-cache needs room for one iteration's rows besides at least one pinned row; the
    other caching modes need each trainer's distinct rows of any one iteration, which the
    safe bound (B/T) x F answers without reading the data, and a pass over it otherwise.
    With P planner workers each worker's share of C must hold its keys' part of them: the
    safe bound is P x (B/T) x F, and the pass finds P x the largest part.
    """
    elastic = f" at {job.spec.trainers.count} trainer(s), a count this elastic job may come to" \
        if job.spec.trainers.elastic else ""
    config = PlannerConfig(**_planner_fields(job, 0))  # checks each field (C where used)
    bound = capacity_bound(config, job.spec.train.batch_size, job.layout.num_tables)  # and B
    if config.mode == "local":
        return
    if config.mode == "static-cache":
        if config.capacity <= bound:
            raise ConfigError(
                "oracle.cache_rows",
                f"C = {config.capacity} leaves no row to pin: static-cache keeps room for one "
                f"iteration's other rows ((B/T) x F = {bound}), so it needs C >= {bound + 1}",
            )
        return
    if config.capacity >= config.workers * bound:
        return
    if job.data.watch:
        raise ConfigError("oracle.cache_rows", f"C = {config.capacity} may not hold one iteration's rows, and a "
                          f"stream (data.watch) cannot be read ahead to check: set C >= {config.workers * bound} "
                          "(P x (B/T) x F, the rows one iteration can touch)")  # fmt: skip
    need = required_capacity(config, (keys for keys, _, _ in build_workload(job).key_batches()))
    if config.capacity < need:
        workers = f" with oracle.planner_workers = {config.workers}" if config.workers > 1 else ""
        raise ConfigError(
            "oracle.cache_rows",
            f"C = {config.capacity} cannot hold one iteration's rows{workers}{elastic}: this data needs C >= {need}",
        )


def _planner_fields(job: Job, first_iteration: int) -> dict[str, Any]:
    """PlannerConfig's fields from the spec, without the static cache's hot set."""
    spec = job.spec
    return dict(
        num_trainers=spec.trainers.count,
        lookahead=spec.oracle.lookahead,
        prefetch_lead=spec.oracle.prefetch_lead,
        capacity=spec.oracle.cache_rows,
        mode=spec.oracle.mode,
        workers=spec.oracle.planner_workers,
        checkpoint_every=spec.checkpoint.every,
        total_rows=job.layout.total_rows,
        first_iteration=first_iteration,
    )
