"""The bagpipe rules' state (oracle/kernels/): entries and records in one store that grows
between kernel calls, records at home or in blocks, memory per key independent of T."""

from __future__ import annotations

import numpy as np
import pytest

import oracle.bagpipe
from oracle.config import PlannerConfig, required_capacity
from oracle.kernels.layout import ENTRY_ROWS, POOL_USED
from oracle.kernels.state import BagpipeState, reuse_events
from oracle.planner import Planner
from tests.oracle.reference_planner import reference_plan
from tests.oracle.simulator import plan_incrementally, simulate, wire


def _stream(trainers: int, iterations: int, keys: int, seed: int) -> list[np.ndarray]:
    """Hot keys shared by every trainer (records in blocks) beside a cold tail (at home)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(iterations):
        shape = (trainers * 8, 3)
        hot = rng.integers(0, 6, size=shape)
        cold = rng.integers(6, keys, size=shape)
        out.append(np.where(rng.random(shape) < 0.3, hot, cold))
    return out


@pytest.mark.parametrize("trainers", [3, 8])
def test_a_store_that_grows_mid_batch_plans_as_the_reference(
    trainers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    grown = []
    real = oracle.bagpipe.grow_store

    def counted(state: BagpipeState) -> BagpipeState:
        grown.append(int(state.counters[POOL_USED]))
        return real(state)

    monkeypatch.setattr(oracle.bagpipe, "grow_store", counted)
    batches = _stream(trainers, 30, 5000, seed=trainers)
    settings = dict(num_trainers=trainers, lookahead=8, prefetch_lead=2, checkpoint_every=5)
    need = required_capacity(PlannerConfig(**settings, capacity=1 << 20), batches)  # type: ignore[arg-type]
    config = PlannerConfig(**settings, capacity=need)  # type: ignore[arg-type]
    directives = plan_incrementally(config, batches)
    assert grown, "the store never grew: the test does not reach the path it is for"
    assert wire(directives) == wire(reference_plan(config, batches))
    simulate(config, batches, directives, seed=1)


def test_memory_per_key_does_not_grow_with_trainers() -> None:
    """The same keys, read by 2 or by 64 trainers, each key by one of them: the store holds
    the same rows (an entry with its records at home per key)."""
    used = {}
    for trainers in (2, 64):
        config = PlannerConfig(num_trainers=trainers, lookahead=50, prefetch_lead=1, capacity=64)
        planner = Planner(config)
        keys = np.arange(64 * 4).reshape(64, 4)  # 4 samples a trainer at T = 64: one key each
        planner.push(keys)
        state = planner._rules._state  # type: ignore[attr-defined]
        used[trainers] = int(state.counters[POOL_USED])
    assert used[2] == used[64] == ENTRY_ROWS * 64 * 4


def test_event_buffers_are_reused_while_large_enough_and_reset_for_each_iteration() -> None:
    """`reuse_events`: the same buffers while an iteration fits (numpy's fresh buffers of
    4 MB and more cost a zeroed huge page at each first touch), larger ones when it does
    not; counts and stats start at zero and every pair without a slot, whatever the last
    iteration left."""
    ev = reuse_events(None, 100, 40, 3, 50, 0)
    ev.counts[:] = 7
    ev.stats[:] = 7
    ev.pair_slot[:] = 5
    again = reuse_events(ev, 90, 40, 3, 50, 0)
    assert again.fetch is ev.fetch and again.group_slots is ev.group_slots
    assert not again.counts.any() and not again.stats.any()
    assert again.pair_slot.shape == (90,) and (again.pair_slot == -1).all()
    bigger = reuse_events(again, 400, 40, 3, 50, 10)
    assert bigger.fetch is not ev.fetch and bigger.fetch.shape[0] >= 400 + 3 * 40
    assert bigger.join_dst.shape[0] >= 400 and bigger.flush_prev.shape[0] >= 10
    assert bigger.group_slots is ev.group_slots  # still large enough
    assert reuse_events(bigger, 10, 4, 5, 50, 0).stats.shape == (5, bigger.stats.shape[1])  # another T
