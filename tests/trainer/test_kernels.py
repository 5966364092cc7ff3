"""The trainer's numba kernels against their numpy specifications (the row-wise Adagrad
kernel is held to the torch ops in tests/trainer/test_optim.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.kernels import used_slots


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
