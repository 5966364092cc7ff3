"""Planner API: configuration errors, capacity checks, finality timing, determinism, stats."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import ConfigError
from oracle.config import capacity_bound, hottest_keys, required_capacity
from oracle.planner import Planner, PlannerConfig
from tests.oracle.reference_planner import reference_plan
from tests.oracle.simulator import Workload, plan_incrementally, simulate, wire


def config(**kw: object) -> PlannerConfig:
    args: dict[str, object] = dict(num_trainers=2, lookahead=3, prefetch_lead=2, capacity=8)
    args.update(kw)
    return PlannerConfig(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_trainers": 0}, "trainers.count"),
        ({"num_trainers": 1 << 13}, "trainers.count"),
        ({"lookahead": -1}, "oracle.lookahead"),
        ({"prefetch_lead": 1.5}, "oracle.prefetch_lead"),
        ({"capacity": 0}, "oracle.cache_rows"),
        ({"checkpoint_every": -1}, "checkpoint.every"),
        ({"first_iteration": -1}, "--first-iteration"),
        ({"total_rows": -1}, "data.table_sizes"),
        ({"mode": "lru"}, "oracle.mode"),
        ({"mode": "local"}, "data.table_sizes"),
        ({"hot_keys": np.array([3, 1])}, "oracle.mode"),
        ({"mode": "static-cache", "hot_keys": np.arange(9)}, "oracle.cache_rows"),
        ({"workers": 0}, "oracle.planner_workers"),
        ({"workers": 1 << 9}, "oracle.planner_workers"),
        ({"workers": 2, "mode": "no-cache"}, "oracle.planner_workers"),
        ({"workers": 9}, "oracle.cache_rows"),
    ],
)
def test_config_errors_name_the_spec_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(**kw)
    assert err.value.field == field


@pytest.mark.parametrize(
    "hot", [np.array([[1, 2]]), np.array([1.0, 2.0]), np.array([3, 1]), np.array([-1, 2])]
)
def test_a_malformed_hot_set_is_the_callers_bug(hot: np.ndarray) -> None:
    with pytest.raises(ValueError, match="hot_keys"):
        config(mode="static-cache", hot_keys=hot)


def test_batch_must_split_evenly() -> None:
    with pytest.raises(ConfigError, match="train.batch_size: .* multiple of trainers.count = 2"):
        Planner(config()).push(np.zeros((3, 2), np.int64))


@pytest.mark.parametrize(
    ("kw", "keys"),
    [
        ({}, np.zeros(4, np.int64)),
        ({}, np.zeros((4, 2), np.float64)),
        ({}, np.full((4, 2), -1)),
        ({"mode": "local", "total_rows": 5}, np.full((4, 2), 5)),
    ],
)
def test_a_malformed_batch_is_the_callers_bug(kw: dict[str, object], keys: np.ndarray) -> None:
    with pytest.raises(ValueError):
        Planner(config(**kw)).push(keys)


def test_batches_keep_their_shape_and_stop_at_finish() -> None:
    planner = Planner(config())
    planner.push(np.zeros((4, 2), np.int64))
    with pytest.raises(ValueError, match="differs"):
        planner.push(np.zeros((4, 3), np.int64))
    planner.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        planner.push(np.zeros((4, 2), np.int64))


def test_infeasible_capacity_names_iteration_trainer_and_need() -> None:
    planner = Planner(config(capacity=3, lookahead=1))
    planner.push(np.zeros((4, 2), np.int64))
    planner.push(np.array([[0, 1], [2, 3], [0, 0], [0, 0]]))  # iteration 1: trainer 0 uses 4 rows
    with pytest.raises(ConfigError, match=r"trainer 0 uses 4 distinct rows at iteration 1; C >= 4"):
        planner.push(np.zeros((4, 2), np.int64))


def test_capacity_helpers() -> None:
    assert capacity_bound(config(), batch_size=10, num_features=2) == 10  # (B/T) x F
    static = config(mode="static-cache", hot_keys=np.array([3, 7]))
    assert capacity_bound(static, batch_size=10, num_features=2) == 2 + 10
    batches = [np.array([[1, 2], [3, 3]]), np.array([[5, 5], [5, 6]])]
    assert required_capacity(config(), batches) == 2
    assert list(hottest_keys([np.array([[4, 4], [2, 9]]), np.array([[2, 4], [7, 2]])], 2)) == [2, 4]


def test_directive_is_final_after_l_plus_max_d_1_batches() -> None:
    cfg, batches = Workload(
        trainers=3, per_trainer=2, features=2, iterations=12, keys=9, lookahead=3, lead=2,
        slack=1, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=5,
    ).build()
    planner = Planner(cfg)
    emitted = []
    for z, b in enumerate(batches):
        out = planner.push(b)
        emitted += out
        assert len(emitted) == max(0, z + 1 - 3 - 2)
    emitted += planner.finish()
    assert wire(emitted) == wire(plan_incrementally(cfg, batches))
    assert all(d.iteration == x and d.trainer == j for x, ds in enumerate(emitted) for j, d in enumerate(ds))


def test_no_cache_is_bagpipe_with_l_and_d_zero() -> None:
    cfg, batches = Workload(
        trainers=3, per_trainer=2, features=2, iterations=8, keys=12, lookahead=0, lead=0,
        slack=0, mode="no-cache", stream="zipf", checkpoint_every=3, hot=0, seed=2,
    ).build()
    bagpipe = PlannerConfig(
        num_trainers=3, lookahead=0, prefetch_lead=0, capacity=cfg.capacity, checkpoint_every=3,
        write_lag=cfg.write_lag,
    )
    assert wire(plan_incrementally(cfg, batches)) == wire(plan_incrementally(bagpipe, batches))


def test_keys_far_beyond_any_dense_array_are_planned() -> None:
    """State is sized by the cache and the window, never by the key space."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 1 << 40, size=(4, 3)) for _ in range(6)]
    cfg = PlannerConfig(num_trainers=2, lookahead=2, prefetch_lead=1, capacity=6)
    simulate(cfg, batches, plan_incrementally(cfg, batches))


@pytest.mark.parametrize("mode", ["bagpipe", "no-cache", "static-cache"])
def test_memory_grows_with_the_window_not_the_run(mode: str) -> None:
    """New keys every other iteration; in between, keys that come back after 2, 6 and 12
    iterations: the planner forgets each write-back's version once it has landed
    (`PlannerConfig.landed_through`), so the keys it holds repeat with the stream instead of
    growing, some fetches ask for a version and others for -1, and the directives stay the
    reference's and exact."""
    n = 800

    def batch(x: int) -> np.ndarray:
        if x % 2:
            return np.arange(1000 + 16 * x, 1016 + 16 * x).reshape(8, 2)
        m = x // 2
        every_2, every_6, every_12 = np.arange(4), 100 + 6 * (m % 3) + np.arange(6), 200 + 6 * (m % 6) + np.arange(6)
        return np.concatenate([every_2, every_6, every_12]).reshape(8, 2)

    batches = [batch(x) for x in range(n)]
    hot = np.arange(2) if mode == "static-cache" else np.zeros(0, np.int64)
    cfg = PlannerConfig(
        num_trainers=2, lookahead=4, prefetch_lead=2, capacity=64, mode=mode, write_lag=4, hot_keys=hot,  # type: ignore[arg-type]
    )
    planner = Planner(cfg)
    held, directives = [], []
    for batch in batches:
        directives += planner.push(batch)
        held.append(planner.keys_held)
    directives += planner.finish()
    distinct = len(np.unique(np.concatenate(batches)))
    assert max(held[-n // 4 :]) == max(held[n // 8 : n // 4]) < distinct // 8
    versions = np.concatenate([d.prefetch_min_versions for ds in directives for d in ds])
    assert (versions >= 0).sum() > n // 4 and (versions == -1).sum() > distinct
    assert wire(directives) == wire(reference_plan(cfg, batches))
    simulate(cfg, batches, directives)


def test_stats_agree_with_the_directives() -> None:
    cfg, batches = Workload(
        trainers=4, per_trainer=3, features=2, iterations=15, keys=20, lookahead=4, lead=1,
        slack=2, mode="bagpipe", stream="zipf", checkpoint_every=0, hot=0, seed=9,
    ).build()
    planner = Planner(cfg)
    directives = [d for b in batches for d in planner.push(b)] + planner.finish()
    s = planner.stats
    assert s.total("prefetched") == sum(d.prefetch_keys.size for ds in directives for d in ds)
    assert s.total("joined") == sum(int((d.join_recv_slots >= 0).sum()) for ds in directives for d in ds)
    assert s.total("written") == sum(d.write_keys.size for ds in directives for d in ds)
    assert s.total("sync_now") == sum(ds[0].sync_now_keys.size for ds in directives)
    assert s.total("uses") == s.total("hits") + s.total("fetched") + s.total("joined")
    assert 0 < s.hit_rate < 1 and max(s.peak_occupancy) <= cfg.capacity
    assert s.iterations == len(directives) == 15 and s.first == 0
