"""`PlannerConfig.first_iteration`: a planner started at global iteration F (recovery from
checkpoint F-1, docs/design.md#resuming-every-role) numbers every iteration-valued field from F and marks checkpoints by
global number, and nothing else changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.directive import Directive
from common.errors import ConfigError
from oracle.planner import Planner, PlannerConfig
from tests.oracle.reference_planner import reference_plan
from tests.oracle.simulator import Workload, plan_incrementally, simulate, wire
from tests.oracle.test_planner_properties import FAST, workloads

firsts = st.one_of(st.integers(1, 12), st.integers(1000, 1 << 20))


def offset(config: PlannerConfig, first: int) -> PlannerConfig:
    return dataclasses.replace(config, first_iteration=first)


def shifted(d: Directive, first: int) -> Directive:
    """What the unoffset directive `d` must become when the planner starts at `first`."""
    v = d.prefetch_min_versions
    return dataclasses.replace(
        d,
        iteration=d.iteration + first,
        prefetch_targets=(d.prefetch_targets + first).astype(np.int32),
        prefetch_min_versions=np.where(v >= 0, v + first, v),
    )


@pytest.mark.parametrize("value", [-1, 1.0, "3"])
def test_first_iteration_is_validated(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        PlannerConfig(
            num_trainers=2, lookahead=1, prefetch_lead=1, capacity=4, first_iteration=value  # type: ignore[arg-type]
        )
    assert err.value.field == "--first-iteration"


@settings(FAST, max_examples=300)
@given(workloads(max_trainers=6), firsts)
def test_offset_production_matches_reference(w: Workload, first: int) -> None:
    config, batches = w.build()
    config = offset(config, first)
    assert wire(plan_incrementally(config, batches)) == wire(reference_plan(config, batches))


@settings(FAST, max_examples=200)
@given(workloads(max_trainers=6), firsts)
def test_offset_only_shifts_iteration_fields(w: Workload, first: int) -> None:
    config, batches = dataclasses.replace(w, checkpoint_every=0).build()
    base = plan_incrementally(config, batches)
    moved = plan_incrementally(offset(config, first), batches)
    assert wire(moved) == wire([[shifted(d, first) for d in ds] for ds in base])
    assert [d.iteration for ds in moved for d in ds[:1]] == list(range(first, first + len(batches)))


@settings(FAST, max_examples=400)
@given(workloads(), firsts)
def test_offset_passes_simulation_against_a_resumed_ps(w: Workload, first: int) -> None:
    """The simulated PS starts with versions up to first-1; every read stays exact."""
    config, batches = w.build()
    config = offset(config, first)
    simulate(config, batches, plan_incrementally(config, batches), seed=w.seed)


def test_mislabelled_versions_fail_the_resumed_simulation() -> None:
    """The simulator does notice an offset planner that forgets to shift versions."""
    config, batches = Workload(
        trainers=2, per_trainer=2, features=2, iterations=10, keys=6, lookahead=1, lead=1,
        slack=0, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=4,
    ).build()
    relabelled = [  # iterations and targets moved to 20.., versions left as they were
        [dataclasses.replace(d, iteration=d.iteration + 20, prefetch_targets=d.prefetch_targets + 20) for d in ds]
        for ds in plan_incrementally(config, batches)
    ]
    with pytest.raises(AssertionError):
        simulate(offset(config, 20), batches, relabelled)


@pytest.mark.parametrize("mode", ["bagpipe", "static-cache", "no-cache"])
@pytest.mark.parametrize("every", [1, 3, 4])
def test_checkpoints_land_on_the_same_global_iterations(mode: str, every: int) -> None:
    """Resuming after checkpoint c marks, and flushes for, the checkpoints of a full run."""
    config, batches = Workload(
        trainers=3, per_trainer=2, features=2, iterations=16, keys=15, lookahead=3, lead=2,
        slack=1, mode=mode, stream="zipf", checkpoint_every=every, hot=3 if mode == "static-cache" else 0,
        seed=11,
    ).build()
    full = plan_incrementally(config, batches)
    marked = [x for x, ds in enumerate(full) if ds[0].checkpoint]
    assert marked == [x for x in range(16) if (x + 1) % every == 0]
    for c in [*marked[:2], 6]:  # resume after a checkpoint, and once after a plain iteration
        resumed_config = offset(config, c + 1)
        resumed = plan_incrementally(resumed_config, batches[c + 1 :])
        assert [ds[0].iteration for ds in resumed] == list(range(c + 1, 16))
        assert [ds[0].iteration for ds in resumed if ds[0].checkpoint] == [x for x in marked if x > c]
        assert all(all(d.checkpoint == ds[0].checkpoint for d in ds) for ds in resumed)
        simulate(resumed_config, batches[c + 1 :], resumed, seed=c)  # flushes make each checkpoint whole


def test_stats_and_push_finality_use_global_numbers() -> None:
    config, batches = Workload(
        trainers=2, per_trainer=2, features=2, iterations=9, keys=8, lookahead=2, lead=1,
        slack=1, mode="bagpipe", stream="uniform", checkpoint_every=0, hot=0, seed=3,
    ).build()
    planner = Planner(offset(config, 100))
    emitted = []
    for z, b in enumerate(batches):
        emitted += planner.push(b)
        assert len(emitted) == max(0, z + 1 - 2 - 1)  # finality is unchanged: L + max(D, 1)
    emitted += planner.finish()
    assert [ds[0].iteration for ds in emitted] == list(range(100, 109))
    stats = planner.stats
    assert (stats.first, stats.iterations, stats.last and stats.last.iteration) == (100, 9, 108)
