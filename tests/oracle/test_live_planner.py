"""The live planner (oracle/live.py): a stream cut into segments anywhere still passes the
value-level simulator in every mode, whatever the cuts; dropping either of the two things
that make a cut safe is caught; a replayed plan (`ends`) is byte-identical to the original.

Budgets as in tests/oracle/test_planner_properties.py: derandomized cases in the fast tier,
fresh ones each run in CI's (`slow`), thousands nightly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.directive import Directive
from oracle.config import PlannerConfig
from oracle.live import LivePlanner
from tests.oracle.simulator import SimulationError, Workload, in_process_planner, simulate, wire
from tests.oracle.test_planner_properties import FAST, workloads


def plan_live(config: PlannerConfig, batches: list[np.ndarray], ends: set[int],
              planner_class: type[LivePlanner] = LivePlanner) -> list[list[Directive]]:
    """The batches pushed one at a time, a segment ended before each iteration in `ends`."""
    make = (lambda c: in_process_planner(c)) if config.workers > 1 else None
    planner = planner_class(config, **({"make_planner": make} if make else {}))
    out: list[list[Directive]] = []
    for x, keys in enumerate(batches, start=config.first_iteration):
        if x in ends:
            out += planner.end_segment()
        out += planner.push(keys)
    return out + planner.finish()


@st.composite
def cut_workloads(draw: st.DrawFn, **kwargs: object) -> tuple[Workload, set[int]]:
    w = draw(workloads(**kwargs))
    n = w.iterations * w.epochs
    ends = draw(st.sets(st.integers(1, max(1, n - 1)), max_size=n)) if n > 1 else set()
    return w, ends


def check_cut(case: tuple[Workload, set[int]], planner_class: type[LivePlanner] = LivePlanner) -> None:
    w, ends = case
    config, batches = w.build()
    simulate(config, batches, plan_live(config, batches, ends, planner_class), seed=w.seed)


@settings(FAST, max_examples=300)
@given(cut_workloads(modes=("bagpipe",)))
def test_bagpipe_cut_anywhere_passes_simulation(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


@settings(FAST, max_examples=200)
@given(cut_workloads(modes=("no-cache", "static-cache", "local")))
def test_baselines_cut_anywhere_pass_simulation(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


@settings(FAST, max_examples=150)
@given(cut_workloads(checkpointed=True))
def test_checkpointed_runs_cut_anywhere_pass_simulation(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


@settings(FAST, max_examples=60)
@given(cut_workloads(parallel=True, checkpointed=True))
def test_parallel_planning_cut_anywhere_passes_simulation(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


@pytest.mark.slow
@settings(FAST, max_examples=150, derandomize=False)  # fresh cases each run
@given(cut_workloads(checkpointed=True))
def test_cut_anywhere_more(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=5000, derandomize=False)
@given(cut_workloads(checkpointed=True))
def test_cut_anywhere_many(case: tuple[Workload, set[int]]) -> None:
    check_cut(case)


class CarriesNoVersions(LivePlanner):
    """A new segment's fetches ask only for what its own planner knows."""

    def _carry(self, final: list[list[Directive]]) -> list[list[Directive]]:
        self._carried = dataclasses.replace(self._carried, keys=self._carried.keys[:0])
        return super()._carry(final)


class EndsWithSyncLater(LivePlanner):
    """A segment's last directive keeps its sync_later keys."""

    def end_segment(self) -> list[list[Directive]]:
        if self._planner is None:
            return []
        out = self._carry(self._finished_planner())
        self.segment_ends.append(self._read)
        return out


@pytest.mark.parametrize("mutant", [CarriesNoVersions, EndsWithSyncLater])
def test_the_simulator_catches_an_unsafe_cut(mutant: type[LivePlanner]) -> None:
    """Each mutant fails on some of a fixed set of cut workloads where `LivePlanner` passes."""
    caught = 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        w = Workload(trainers=int(rng.integers(2, 5)), per_trainer=2, features=2, iterations=12,
                     keys=int(rng.integers(3, 12)), lookahead=int(rng.integers(1, 4)), lead=int(rng.integers(0, 3)),
                     slack=1, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=seed, write_lag=1)
        ends = {int(e) for e in rng.choice(np.arange(1, 12), size=4, replace=False)}
        check_cut((w, ends))  # the real one passes
        try:
            check_cut((w, ends), mutant)
        except SimulationError:
            caught += 1
    assert caught > 0


def test_a_replayed_plan_is_the_plan_it_replays() -> None:
    """An oracle restarted alone replans with the cuts it logged (`ends`): the same bytes."""
    w = Workload(trainers=3, per_trainer=2, features=3, iterations=20, keys=30, lookahead=3, lead=2,
                 slack=2, mode="bagpipe", stream="zipf", checkpoint_every=4, hot=0, seed=7)
    config, batches = w.build()
    cut = plan_live(config, batches, {3, 4, 11, 17})
    replayed = LivePlanner(config, ends=[3, 4, 11, 17])
    out: list[list[Directive]] = []
    for keys in batches:
        out += replayed.push(keys)
    out += replayed.finish()
    assert wire(out) == wire(cut)
    assert replayed.segment_ends == [3, 4, 11, 17]


def test_a_stream_never_cut_is_planned_as_offline() -> None:
    w = Workload(trainers=2, per_trainer=3, features=2, iterations=15, keys=25, lookahead=4, lead=1,
                 slack=0, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=3)
    config, batches = w.build()
    from tests.oracle.simulator import plan_incrementally

    assert wire(plan_live(config, batches, set())) == wire(plan_incrementally(config, batches))


def test_a_cut_ends_with_no_sync_later_and_the_next_segment_restarts_numbering() -> None:
    w = Workload(trainers=2, per_trainer=3, features=2, iterations=10, keys=8, lookahead=3, lead=2,
                 slack=1, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=11)
    config, batches = w.build()
    planner = LivePlanner(config)
    out: list[list[Directive]] = []
    for keys in batches[:5]:
        out += planner.push(keys)
    assert planner.in_segment and len(out) < 5  # the planner reads ahead
    out += planner.end_segment()
    assert not planner.in_segment and [d[0].iteration for d in out] == [0, 1, 2, 3, 4]
    assert all(d.sync_later_keys.size == 0 for d in out[-1])
    assert planner.end_segment() == []  # nothing to end
    for keys in batches[5:]:
        out += planner.push(keys)
    out += planner.finish()
    assert [d[0].iteration for d in out] == list(range(10)) and planner.segment_ends == [5]
