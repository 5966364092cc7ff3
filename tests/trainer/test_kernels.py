"""The trainer's numba kernels against their numpy specifications (the row-wise Adagrad
kernel is held to the torch ops in tests/trainer/test_optim.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.arrays import in_sorted
from trainer.kernels import end_indices, gather_rows, in_ascending, scatter_rows, used_slots


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 400), capacity=st.integers(1, 300), extra=st.integers(0, 50), seed=st.integers(0, 2**31 - 1))
def test_used_slots_are_numpys_unique_with_its_inverse(n: int, capacity: int, extra: int, seed: int) -> None:
    flat = np.random.default_rng(seed).integers(0, capacity, size=n).astype(np.int32)
    flat.setflags(write=False)  # as a directive decoded from its wire buffer
    size = max(int(flat.max(initial=-1)) + 1, 1) + extra
    slots, index, inverse = used_slots(flat, size)
    want, want_inverse = np.unique(flat, return_inverse=True)
    assert slots.dtype == index.dtype == inverse.dtype == np.int64
    assert np.array_equal(slots, want) and np.array_equal(inverse, want_inverse.reshape(-1))
    assert index.shape == (size + 1,)
    expected = np.full(size + 1, -1)
    expected[want] = np.arange(want.size)
    assert np.array_equal(index, expected)  # -1 for every slot not used, and for slot -1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), capacity=st.integers(1, 400), dim=st.integers(1, 40), width=st.integers(0, 2),
       wide=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_scatter_and_gather_rows_are_numpys_fancy_indexing(
    n: int, capacity: int, dim: int, width: int, wide: bool, seed: int
) -> None:
    """Rows and their state written to unique slots and read back, with int32 and int64
    slots, for any width of rows and state (none included)."""
    rng = np.random.default_rng(seed)
    n = min(n, capacity)
    table = rng.standard_normal((capacity, dim), dtype=np.float32)
    state = rng.standard_normal((capacity, width), dtype=np.float32)
    slots = rng.permutation(capacity)[:n].astype(np.int64 if wide else np.int32)
    buffer = rng.standard_normal((n, dim + width), dtype=np.float32)
    rows, row_state = np.ascontiguousarray(buffer[:, :dim]), np.ascontiguousarray(buffer[:, dim:])
    want_table, want_state = table.copy(), state.copy()
    want_table[slots], want_state[slots] = rows, row_state
    scatter_rows(table, state, slots, rows, row_state)
    assert np.array_equal(table, want_table) and np.array_equal(state, want_state)
    out, out_state = np.empty((n, dim), np.float32), np.empty((n, width), np.float32)
    gather_rows(table, state, slots, out, out_state)
    assert np.array_equal(out, rows) and np.array_equal(out_state, row_state)


@pytest.mark.parametrize("kernel", [scatter_rows, gather_rows])
def test_a_slot_outside_the_table_or_a_wrong_shape_changes_nothing(kernel: object) -> None:
    table, state = np.zeros((8, 4), np.float32), np.zeros((8, 1), np.float32)
    rows, row_state = np.ones((2, 4), np.float32), np.ones((2, 1), np.float32)
    for slots in (np.array([1, 8], np.int32), np.array([-1, 2], np.int64)):
        with pytest.raises(IndexError, match="outside the table"):
            kernel(table, state, slots, rows, row_state)  # type: ignore[operator]
    with pytest.raises(ValueError, match="shapes do not match"):
        kernel(table, state, np.array([1, 2], np.int32), np.ones((2, 3), np.float32), row_state)  # type: ignore[operator]
    assert not table.any() and not state.any() and np.all(rows == 1) and np.all(row_state == 1)


def _read_only(values: np.ndarray) -> np.ndarray:
    values.setflags(write=False)  # as a directive decoded from its wire buffer
    return values


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), m=st.integers(0, 300), span=st.integers(1, 1000), seed=st.integers(0, 2**31 - 1))
def test_in_ascending_is_numpys_isin(n: int, m: int, span: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values, pool = (_read_only(np.unique(rng.integers(-span, span, size=k))) for k in (n, m))
    found = in_ascending(values, pool)
    assert found.dtype == np.bool_ and np.array_equal(found, np.isin(values, pool))
    assert np.array_equal(found, in_sorted(values, pool))


@pytest.mark.parametrize("values", [[1, 1], [2, 1]])
def test_in_ascending_refuses_lists_out_of_order(values: list[int]) -> None:
    with pytest.raises(ValueError, match="not strictly ascending"):
        in_ascending(np.array(values, np.int64), np.arange(3))
    with pytest.raises(ValueError, match="not strictly ascending"):
        in_ascending(np.arange(3), np.array(values, np.int64))


@settings(max_examples=80, deadline=None)
@given(inputs=st.integers(1, 300), capacity=st.integers(1, 300), sync=st.integers(0, 200), leave=st.integers(0, 200),
       seed=st.integers(0, 2**31 - 1))
def test_end_indices_are_their_numpy_definitions(inputs: int, capacity: int, sync: int, leave: int, seed: int) -> None:
    """Over sync lists with slots used, not used and -1, and leave slots anywhere (beyond the
    table too): each sync slot's index among the used ones, the used ones in neither list,
    and the sync_later entries whose slot is >= 0 and does not leave."""
    rng = np.random.default_rng(seed)
    flat = _read_only(rng.integers(0, capacity, size=inputs).astype(np.int32))
    now, later = (_read_only(rng.integers(-1, capacity, size=sync).astype(np.int32)) for _ in range(2))
    leaving = _read_only(rng.integers(0, 2 * capacity, size=leave).astype(np.int32))
    size = capacity  # every slot of the lists above is below it
    used, index, _ = used_slots(flat, size)
    now_at, later_at, alone, alone_slots, stay, stay_slots = end_indices(index, used, now, later, leaving)

    def positions(slots: np.ndarray) -> np.ndarray:
        return np.array([np.searchsorted(used, s) if s >= 0 and s in used else -1 for s in slots], np.int64)

    assert np.array_equal(now_at, positions(now)) and np.array_equal(later_at, positions(later))
    want_alone = np.flatnonzero(~np.isin(used, np.concatenate([now, later])))
    assert np.array_equal(alone, want_alone) and np.array_equal(alone_slots, used[want_alone].astype(np.int32))
    want_stay = np.flatnonzero((later >= 0) & ~np.isin(later, leaving))
    assert np.array_equal(stay, want_stay) and np.array_equal(stay_slots, later[want_stay])
    assert {a.dtype for a in (now_at, later_at, alone, stay)} == {np.dtype(np.int64)}
    assert alone_slots.dtype == stay_slots.dtype == np.int32


def test_end_indices_refuse_a_sync_slot_beyond_the_table() -> None:
    used, index, _ = used_slots(np.array([0, 2], np.int32), 3)
    with pytest.raises(IndexError, match="outside the table"):
        end_indices(index, used, np.array([3], np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))

