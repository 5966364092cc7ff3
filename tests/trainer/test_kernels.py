"""The trainer's numba kernels against their numpy specifications (the row-wise Adagrad
kernel is held to the torch ops in tests/trainer/test_optim.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.kernels import gather_rows, scatter_rows, used_slots


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
