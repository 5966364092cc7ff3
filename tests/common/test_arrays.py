"""The shared array helpers against the numpy functions they replace."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from common.arrays import FEW, bounds, find_sorted, has_duplicates, in_sorted, lazy_zeros, rows_where, sorted_unique


@pytest.mark.parametrize("seed", range(20))
def test_in_sorted_is_isin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = np.unique(rng.integers(0, 50, rng.integers(0, 30)))
    values = rng.integers(-5, 60, rng.integers(0, 40))
    np.testing.assert_array_equal(in_sorted(values, pool), np.isin(values, pool))
    found = find_sorted(values, pool)
    np.testing.assert_array_equal(found >= 0, np.isin(values, pool))
    np.testing.assert_array_equal(pool[found[found >= 0]], values[found >= 0])


@pytest.mark.parametrize("seed", range(20))
def test_has_duplicates_is_unique_shorter(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 60, rng.integers(0, 12))
    assert has_duplicates(values) == (len(np.unique(values)) < len(values))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_sorted_unique_is_unique(seed: int, dtype: type) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(-40, 60, (rng.integers(0, 5), rng.integers(0, 9))).astype(dtype)  # any shape
    got = sorted_unique(values)
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, np.unique(values))


def test_has_duplicates_at_the_edges() -> None:
    assert not has_duplicates(np.zeros(0, np.int64))
    assert not has_duplicates(np.array([7]))
    assert has_duplicates(np.array([3, 1, 3]))
    assert not has_duplicates(np.array([3, 1, 2]))


@pytest.mark.parametrize("size", [0, 1, 4, FEW, FEW + 1, 500])
def test_bounds_are_min_and_max(size: int) -> None:
    values = np.random.default_rng(size).integers(-(2**62), 2**62, size)
    expected = None if size == 0 else (int(values.min()), int(values.max()))
    assert bounds(values) == expected
    if size:
        assert all(type(b) is int for b in bounds(values))
    if size % 2 == 0:
        assert bounds(values.reshape(2, -1)) == expected


def test_bounds_of_a_two_dimensional_array_of_a_few_keys() -> None:
    assert bounds(np.array([[3, -1], [7, 2]])) == (-1, 7)


@pytest.mark.parametrize("shape", [(0,), (7,), (7, 16), (7, 1)])
def test_rows_where_is_boolean_indexing_and_copies_only_a_part(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(5)
    values = rng.random(shape).astype(np.float32)
    for mask in (rng.random(shape[0]) < 0.5, np.zeros(shape[0], bool), np.ones(shape[0], bool)):
        got = rows_where(mask, values)
        assert got.dtype == values.dtype and got.tobytes() == values[mask].tobytes() and got.shape == values[mask].shape
        assert (got is values) == bool(mask.all())


def _resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_lazy_zeros_cost_only_the_pages_written_whatever_the_huge_page_mode() -> None:
    before = _resident_mb()
    table = lazy_zeros((8_000_000, 16), np.float32)  # 512 MB
    rows = np.random.default_rng(0).integers(0, len(table), 2_000)
    table[rows] = 1.0
    grown = _resident_mb() - before
    assert grown < 64, f"{grown:.0f} MB resident after 2,000 random rows of a 512 MB table"
    assert table.dtype == np.float32 and table.shape == (8_000_000, 16) and table.flags.writeable
    assert table.sum() == 16 * len(np.unique(rows)) and not lazy_zeros((3, 2), np.bool_).any()
