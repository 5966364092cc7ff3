"""A trainer's capacity victims (oracle/kernels/heaps.py): bucketed by next use, a heap per
bucket reached, they come out in rule 4's order, whatever the window and the next uses."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.kernels.heaps import pop_victim, top_victim, victim_next
from oracle.kernels.layout import NEVER, SLOT_KEY, SLOT_NEXT, SLOT_STAMP
from oracle.kernels.state import new_state


def _random_cache(seed: int, trainers: int, capacity: int, x: int, horizon: int) -> np.ndarray:
    """Slots [T, C, NUM_SLOT]: some free, some used at x (no victims), the rest with next
    uses anywhere: NEVER, past the window, in it, and at x or before (no copy has one; the
    order must hold for them too)."""
    rng = np.random.default_rng(seed)
    slot = new_state(trainers, capacity, 16, 8).slot
    keys = rng.permutation(4 * capacity)[:capacity]  # a trainer holds a key once
    for j in range(trainers):
        held = rng.random(capacity) < 0.8
        slot[j, :, SLOT_KEY] = np.where(held, rng.permutation(keys), -1)
        earlier = rng.integers(-2, x, capacity)
        slot[j, :, SLOT_STAMP] = np.where(rng.random(capacity) < 0.2, x, earlier)
        choice = rng.integers(0, 4, capacity)
        never = np.full(capacity, NEVER)
        near = rng.integers(x + 1, horizon + 1, capacity) if horizon > x else never
        past = horizon + 1 + rng.integers(0, 9, capacity)
        before = rng.integers(0, x + 1, capacity)
        kinds = [choice == 0, choice == 1, choice == 2]
        slot[j, :, SLOT_NEXT] = np.select(kinds, [never, past, before], near)
    return slot


def _expected(slot: np.ndarray, j: int, x: int, horizon: int) -> list[tuple[int, int]]:
    """Rule 4's order by sorting: (slot, next use), farthest first, ties larger key first."""
    rows = []
    for s in range(slot.shape[1]):
        if slot[j, s, SLOT_KEY] >= 0 and slot[j, s, SLOT_STAMP] < x:
            nxt = int(slot[j, s, SLOT_NEXT])
            rows.append((nxt if nxt <= horizon else int(NEVER), int(slot[j, s, SLOT_KEY]), s))
    return [(s, nxt) for nxt, _, s in sorted(rows, reverse=True)]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(1, 400),
    x=st.integers(0, 30),
    lookahead=st.sampled_from([0, 1, 3, 200, 255, 256, 700]),  # one rank a bucket, or several
)
def test_victims_come_out_in_rule_4_order(seed: int, capacity: int, x: int, lookahead: int) -> None:
    trainers, horizon = 2, x + lookahead
    state = new_state(trainers, capacity, 16, 8)
    slot = _random_cache(seed, trainers, capacity, x, horizon)
    heaps, starts, info = state.victims, state.victim_starts, state.victims_info
    for j in range(trainers):
        taken = []
        while (s := top_victim(slot, state.victim_bucket, heaps, starts, info, j, x, horizon)) >= 0:
            nxt = victim_next(heaps, info, j)
            assert pop_victim(heaps, starts, info, j) == s
            taken.append((s, nxt))
        assert taken == _expected(slot, j, x, horizon)


def test_victims_are_gathered_again_at_the_next_iteration() -> None:
    """What is left at x is stale at x + 1: the copies are gathered again."""
    x, horizon = 5, 20
    state = new_state(1, 50, 16, 8)
    slot = _random_cache(7, 1, 50, x, horizon)
    heaps, starts, info = state.victims, state.victim_starts, state.victims_info
    top_victim(slot, state.victim_bucket, heaps, starts, info, 0, x, horizon)
    for _ in range(3):
        pop_victim(heaps, starts, info, 0)
    taken = []
    while (s := top_victim(slot, state.victim_bucket, heaps, starts, info, 0, x + 1, horizon + 1)) >= 0:
        taken.append((s, victim_next(heaps, info, 0)))
        pop_victim(heaps, starts, info, 0)
    assert taken == _expected(slot, 0, x + 1, horizon + 1)
