"""Property tests over generated workloads: production == reference byte for byte, and every
directive stream passes the value-level simulator (docs/design.md#invariants, #verification).
Parallel planning (P = 2, 3 workers, bagpipe; docs/design.md#parallel-planning) against the
reference planner run per key partition and merged.

Three budgets: the fast tier's cases are derandomized and few; the `slow` ones (in the
README's test command, which CI runs) add 100 to 250 fresh cases per property each run, so
that every CI run tries workloads no earlier one did; the `nightly` ones (`pytest -m
nightly`) run tens of thousands, for confidence.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracle.reference_planner import reference_plan
from tests.oracle.simulator import MODES, STREAMS, Workload, plan_incrementally, simulate, wire

FAST = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def workloads(
    draw: st.DrawFn,
    modes: tuple[str, ...] = MODES,
    max_trainers: int = 8,
    checkpointed: bool = False,
    parallel: bool = False,
) -> Workload:
    """Random workloads; `checkpointed` ones take a checkpoint every 1 to 10 iterations over
    one to four epochs of their stream, where shared keys come and go across checkpoints;
    `parallel` ones plan bagpipe with 2 or 3 workers."""
    mode = "bagpipe" if parallel else draw(st.sampled_from(modes))
    return Workload(
        trainers=draw(st.integers(2 if checkpointed else 1, max_trainers)),
        per_trainer=draw(st.integers(1, 3)),
        features=draw(st.integers(1, 3)),
        iterations=draw(st.integers(2 if checkpointed else 1, 12)),
        keys=draw(st.integers(1, 40)),
        lookahead=draw(st.integers(0, 6)),
        lead=draw(st.integers(0, 8)),
        slack=draw(st.sampled_from([0, 0, 1, 3])),
        mode=mode,
        stream=draw(st.sampled_from(STREAMS)),
        checkpoint_every=draw(st.integers(1, 10) if checkpointed else st.integers(0, 3)),
        hot=draw(st.integers(0, 4)) if mode == "static-cache" else 0,
        seed=draw(st.integers(0, 2**31)),
        write_lag=draw(st.integers(1, 6)),
        epochs=draw(st.integers(1, 4)) if checkpointed else 1,
        workers=draw(st.integers(2, 3)) if parallel else 1,
    )


def check_simulation(w: Workload) -> None:
    config, batches = w.build()
    simulate(config, batches, plan_incrementally(config, batches), seed=w.seed)


def check_equivalence(w: Workload) -> None:
    config, batches = w.build()
    assert wire(plan_incrementally(config, batches)) == wire(reference_plan(config, batches))


@settings(FAST, max_examples=400)
@given(workloads(modes=("bagpipe",)))
def test_bagpipe_passes_simulation(w: Workload) -> None:
    check_simulation(w)


@settings(FAST, max_examples=200)
@given(workloads(modes=("no-cache", "static-cache", "local")))
def test_baselines_pass_simulation(w: Workload) -> None:
    check_simulation(w)


@settings(FAST, max_examples=300)
@given(workloads(max_trainers=6))
def test_production_matches_reference(w: Workload) -> None:
    check_equivalence(w)


@settings(FAST, max_examples=300)
@given(workloads(modes=("bagpipe",), checkpointed=True))
def test_bagpipe_with_checkpoints_passes_simulation(w: Workload) -> None:
    check_simulation(w)


@settings(FAST, max_examples=100)
@given(workloads(modes=("no-cache", "static-cache", "local"), checkpointed=True))
def test_baselines_with_checkpoints_pass_simulation(w: Workload) -> None:
    check_simulation(w)


@settings(FAST, max_examples=150)
@given(workloads(max_trainers=6, checkpointed=True))
def test_production_matches_reference_with_checkpoints(w: Workload) -> None:
    check_equivalence(w)


@settings(FAST, max_examples=150)
@given(workloads(parallel=True, checkpointed=True))
def test_parallel_planning_passes_simulation(w: Workload) -> None:
    check_simulation(w)


@settings(FAST, max_examples=150)
@given(workloads(parallel=True, checkpointed=True))
def test_parallel_planning_matches_the_reference_per_partition(w: Workload) -> None:
    check_equivalence(w)


@pytest.mark.slow
@settings(FAST, max_examples=100, derandomize=False)  # fresh cases each run, beside the 300 fixed ones above
@given(workloads(parallel=True, checkpointed=True))
def test_parallel_planning_more(w: Workload) -> None:
    check_equivalence(w)
    check_simulation(w)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=3000, derandomize=False)
@given(workloads(parallel=True, checkpointed=True))
def test_parallel_planning_many(w: Workload) -> None:
    check_equivalence(w)
    check_simulation(w)


@pytest.mark.slow
@settings(FAST, max_examples=150, derandomize=False)
@given(workloads(checkpointed=True))
def test_simulation_with_checkpoints_more(w: Workload) -> None:
    check_simulation(w)


@pytest.mark.slow
@settings(FAST, max_examples=150, derandomize=False)
@given(workloads(checkpointed=True))
def test_equivalence_with_checkpoints_more(w: Workload) -> None:
    check_equivalence(w)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=10000, derandomize=False)
@given(workloads(checkpointed=True))
def test_simulation_with_checkpoints_many(w: Workload) -> None:
    check_simulation(w)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=3000, derandomize=False)
@given(workloads(checkpointed=True))
def test_equivalence_with_checkpoints_many(w: Workload) -> None:
    check_equivalence(w)


@pytest.mark.slow
@settings(FAST, max_examples=250, derandomize=False)  # fresh cases each run; nightly draws 25,000
@given(workloads())
def test_simulation_more(w: Workload) -> None:
    check_simulation(w)


@pytest.mark.slow
@settings(FAST, max_examples=250, derandomize=False)  # fresh cases each run; nightly draws 25,000
@given(workloads())
def test_equivalence_more(w: Workload) -> None:
    check_equivalence(w)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=20000, derandomize=False)
@given(workloads())
def test_simulation_many(w: Workload) -> None:
    check_simulation(w)


@pytest.mark.slow
@pytest.mark.nightly
@settings(FAST, max_examples=5000, derandomize=False)
@given(workloads())
def test_equivalence_many(w: Workload) -> None:
    check_equivalence(w)
