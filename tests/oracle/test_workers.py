"""Planner worker processes (oracle/workers.py): the real `ProcessPool` against the in-process
pool the property tests use, a worker's ConfigError at the caller, the processes' end, and
one set of processes for every segment of a stream. Each test starts two worker processes
(about a second: they load the cached kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import ConfigError
from oracle.config import PlannerConfig, required_capacity
from oracle.planner import Planner
from tests.oracle.reference_planner import reference_plan
from tests.oracle.simulator import in_process_planner, simulate, wire


def _stream(seed: int, n: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.3, size=(12, 3)) - 1) % 300 for _ in range(n)]


def _config(batches: list[np.ndarray], spare: int = 2) -> PlannerConfig:
    base = PlannerConfig(num_trainers=3, lookahead=4, prefetch_lead=2, capacity=1 << 20, workers=2)
    need = required_capacity(base, batches)
    return PlannerConfig(
        num_trainers=3, lookahead=4, prefetch_lead=2, capacity=need + spare, workers=2, checkpoint_every=4
    )


def _run(planner: Planner, batches: list[np.ndarray]) -> list[list[bytes]]:
    out = []
    for b in batches:
        out += planner.push(b)
    out += planner.finish()
    return wire(out)


def test_worker_processes_plan_what_the_in_process_pool_and_the_reference_do() -> None:
    batches = _stream(0)
    cfg = _config(batches)
    planner = Planner(cfg)
    processes = [w.process for w in planner._parallel._pool._workers]  # type: ignore[union-attr]
    got = _run(planner, batches)
    assert got == _run(in_process_planner(cfg), batches)  # type: ignore[arg-type]
    assert got == wire(reference_plan(cfg, batches))
    assert len(got) == len(batches)
    assert planner.stats.hit_rate > 0
    # finish ended the workers
    assert all(p.poll() is not None for p in processes)
    simulate(cfg, batches, reference_plan(cfg, batches))


def test_a_workers_config_error_reaches_the_caller_and_stops_the_workers() -> None:
    # C = 2 gives each worker one slot; a trainer using two keys of one partition at once
    # is infeasible there, which the worker finds and this process raises as itself
    cfg = PlannerConfig(num_trainers=1, lookahead=2, prefetch_lead=1, capacity=2, workers=2)
    planner = Planner(cfg)
    processes = [w.process for w in planner._parallel._pool._workers]  # type: ignore[union-attr]
    keys = np.arange(64, dtype=np.int64).reshape(1, 64)
    with pytest.raises(ConfigError) as err:
        for _ in range(4):
            planner.push(keys)
        planner.finish()
    assert err.value.field == "oracle.cache_rows"
    assert "planner_workers = 2" in str(err.value)
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(RuntimeError, match="push after finish"):
        planner.push(keys)


def test_close_stops_the_workers_without_planning() -> None:
    batches = _stream(1, 5)
    planner = Planner(_config(batches))
    processes = [w.process for w in planner._parallel._pool._workers]  # type: ignore[union-attr]
    planner.push(batches[0])
    planner.close()
    assert all(p.poll() is not None for p in processes)
    planner.close()  # idempotent


def test_the_segments_of_a_stream_plan_in_one_set_of_worker_processes() -> None:
    # cut where a stream runs dry, every segment plans in the processes the first started
    # (restarting P processes at every cut would cost seconds the trainers wait for), and
    # the plan is the one in-process planners make
    from oracle.live import LivePlanner

    batches = _stream(2, 24)
    cfg = _config(batches)
    pids = set()

    def run(live: LivePlanner) -> list[list[bytes]]:
        out = []
        for z, b in enumerate(batches):
            out += live.push(b)
            if live._pool is not None:
                pids.add(tuple(w.process.pid for w in live._pool._workers))
            if z in (5, 6, 13):
                out += live.end_segment()
        out += live.finish()
        return wire(out)

    live = LivePlanner(cfg)
    got = run(live)
    processes = [w.process for w in live._pool._workers]  # type: ignore[union-attr]
    assert live.segment_ends == [6, 7, 14]
    assert len(pids) == 1 and all(p.poll() is None for p in processes)  # the same processes, still there
    assert got == run(LivePlanner(cfg, make_planner=in_process_planner))
    assert live.worker_cpu_s > 0
    live.close()
    assert all(p.poll() is not None for p in processes)
