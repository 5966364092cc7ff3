"""WaitingFetches against a model: after every step the tickets each call returns are exactly
the waiting fetches whose rows have all reached their versions, and each ticket comes back
once."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps.waiting import WaitingFetches

ROWS = 12
ROW = st.integers(0, ROWS - 1)
VERSION = st.integers(-1, 6)

wait = st.tuples(st.just("wait"), st.lists(st.tuples(ROW, VERSION), min_size=1, max_size=6))
write = st.tuples(st.just("write"), st.lists(st.tuples(ROW, VERSION), min_size=1, max_size=6))
#: Any rows raised at once, as a restored snapshot can (the service checks a woken fetch
#: again, for a snapshot that takes rows back).
restore = st.tuples(st.just("restore"), st.lists(VERSION, min_size=ROWS, max_size=ROWS))
cancel = st.tuples(st.just("cancel"), st.integers(0, 20))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(wait, write, restore, cancel), max_size=30))
def test_wakes_exactly_the_fetches_each_change_completes(steps: list[tuple]) -> None:
    index = WaitingFetches(ROWS)
    versions = np.full(ROWS, -1, dtype=np.int64)
    model: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # ticket → (rows, versions needed)

    def complete() -> set[int]:
        done = {t for t, (rows, need) in model.items() if (versions[rows] >= need).all()}
        for t in done:
            del model[t]
        return done

    for kind, arg in steps:
        if kind == "wait":
            rows = np.array([r for r, _ in arg], dtype=np.int64)
            need = np.array([v for _, v in arg], dtype=np.int64)
            ticket = index.wait(rows, need, versions)
            if (versions[rows] >= need).all():
                assert ticket is None
            else:
                assert ticket is not None and ticket not in model
                model[ticket] = (rows, need)
        elif kind == "write":
            rows = np.array([r for r, _ in arg], dtype=np.int64)
            versions[rows] = np.maximum(versions[rows], [v for _, v in arg])
            assert set(index.written(rows, versions)) == complete()
        elif kind == "restore":
            versions[:] = np.maximum(versions, arg)
            assert set(index.recheck(versions)) == complete()
        else:
            index.cancel(arg)
            model.pop(arg, None)
        assert len(index) == len(model)


def test_a_write_to_rows_nobody_waits_for_checks_nothing_else() -> None:
    index = WaitingFetches(8)
    versions = np.full(8, -1, dtype=np.int64)
    ticket = index.wait(np.array([1, 2]), np.array([3, 3]), versions)
    versions[[5, 6]] = 9
    assert index.written(np.array([5, 6]), versions) == []
    versions[1] = 3
    assert index.written(np.array([1]), versions) == []  # row 2 is still behind
    versions[2] = 4
    assert index.written(np.array([2]), versions) == [ticket]
    assert len(index) == 0
