"""Cutting an iteration's events into its directives' lists (oracle/kernels/parts.py): the
same rows, in the same order, as sorting them with numpy by (trainer[, target], key) would
give, keys that repeat within a group included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.kernels.layout import EV_KEY, EV_TARGET, EV_TRAINER
from oracle.kernels.parts import rows_by_group, split_groups


def _events(seed: int, runs: int, trainers: int, targets: int) -> np.ndarray:
    """Fetch-like rows [trainer, key, slot, version, target] in a few runs, each ascending
    by key as the planner files them; keys repeat across runs and trainers."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(runs):
        n = int(rng.integers(0, 40))
        rows = np.empty((n, 5), np.int64)
        rows[:, EV_TRAINER] = rng.integers(0, trainers, n)
        rows[:, EV_KEY] = np.sort(rng.integers(0, 30, n))
        rows[:, 2] = rng.integers(0, 1000, n)  # a distinct payload per row shows the order
        rows[:, 3] = rng.integers(-1, 5, n)
        rows[:, EV_TARGET] = 7 + rng.integers(0, targets, n)
        parts.append(rows)
    return np.concatenate(parts) if parts else np.zeros((0, 5), np.int64)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), runs=st.integers(0, 4), trainers=st.integers(1, 9),
       targets=st.integers(1, 4), by_target=st.booleans())
def test_rows_come_by_trainer_then_target_then_in_stable_key_order(
    seed: int, runs: int, trainers: int, targets: int, by_target: bool
) -> None:
    events = _events(seed, runs, trainers, targets)
    by_key = np.argsort(events[:, EV_KEY], kind="stable")
    rows, starts = rows_by_group(events, by_key, EV_TRAINER, EV_TARGET if by_target else -1, trainers)
    # np.lexsort is stable: equal (trainer, target, key) rows keep the order they came in
    columns = (events[:, EV_KEY], *((events[:, EV_TARGET],) if by_target else ()), events[:, EV_TRAINER])
    expected = events[np.lexsort(columns)]
    np.testing.assert_array_equal(rows, expected)
    np.testing.assert_array_equal(starts, np.searchsorted(expected[:, EV_TRAINER], np.arange(trainers + 1)))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.integers(0, 50), trainers=st.integers(1, 33))
def test_sync_groups_split_into_now_and_later_rows_per_trainer(seed: int, groups: int, trainers: int) -> None:
    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, 100, (groups, trainers)).astype(np.int32)
    now = rng.random(groups) < 0.5
    now_slots, later_slots = split_groups(slots, now)
    assert now_slots.dtype == later_slots.dtype == np.int32
    np.testing.assert_array_equal(now_slots, slots[now].T)
    np.testing.assert_array_equal(later_slots, slots[~now].T)
    assert now_slots.flags.c_contiguous and later_slots.flags.c_contiguous
