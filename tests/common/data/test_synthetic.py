from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.data.spec import CRITEO_KAGGLE_SIZES, DataSpec
from common.errors import ConfigError
from common.data.dataset import open_dataset
from common.data.synthetic import (
    CHUNK_ROWS, SyntheticGenerator, _calibrate, calibrate_exponents, overall_top_share, synthetic_config,
    write_synthetic,
)

SMALL = tuple(max(3, n // 100) for n in CRITEO_KAGGLE_SIZES)  # 337k rows in all


def empirical_top1(sparse: np.ndarray, sizes: tuple[int, ...]) -> float:
    """Share of accesses to the most used 1% of all table rows (unseen rows count as 0)."""
    counts = np.sort(np.concatenate([np.bincount(sparse[:, t], minlength=n) for t, n in enumerate(sizes)]))[::-1]
    return counts[: round(0.01 * len(counts))].sum() / counts.sum()


def test_calibration_is_exact_in_expectation() -> None:
    sizes = np.array(CRITEO_KAGGLE_SIZES, float)
    uniform = overall_top_share(sizes, np.zeros(26))
    for target in (uniform + 0.01, 0.92, 0.99):
        alphas = calibrate_exponents(CRITEO_KAGGLE_SIZES, target)
        assert overall_top_share(sizes, alphas) == pytest.approx(target, abs=1e-4)
    with pytest.raises(ConfigError) as info:
        calibrate_exponents(CRITEO_KAGGLE_SIZES, uniform - 0.01)
    assert info.value.field == "data.top1_share"


def test_calibrations_kept_on_disk_are_the_computed_ones_and_a_bad_file_is_computed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sizes = (50, 200, 1000, 5000)
    calibrate_exponents.cache_clear()
    first = calibrate_exponents(sizes, 0.5)
    [kept] = (tmp_path / "bagpipe" / "synthetic").glob("exponents-*.npy")
    assert np.load(kept).tobytes() == first.tobytes() == _calibrate(sizes, 0.5).tobytes()
    for damage in (b"not an array", np.zeros(3).tobytes()):
        kept.write_bytes(damage)
        calibrate_exponents.cache_clear()
        assert calibrate_exponents(sizes, 0.5).tobytes() == first.tobytes()
    assert np.load(kept).tobytes() == first.tobytes()  # and written again, whole
    calibrate_exponents.cache_clear()


def test_water_filling_matches_brute_force() -> None:
    sizes = np.array(SMALL, float)
    for alphas in (np.zeros(26), np.linspace(0.2, 2.5, 26)):
        probs = []
        for n, a in zip(SMALL, alphas, strict=True):
            r = np.arange(1, n + 2, dtype=float)
            cdf = (r ** (1 - a) - 1) if a != 1 else np.log(r)
            probs.append(np.diff(cdf) / cdf[-1])
        p = np.sort(np.concatenate(probs))[::-1] / 26
        assert overall_top_share(sizes, alphas) == pytest.approx(p[: round(0.01 * len(p))].sum(), abs=2e-3)


@pytest.mark.parametrize("target", [0.92, 0.97])
def test_sampled_top1_share_hits_target(target: float) -> None:
    spec = DataSpec(format="synthetic", rows=300_000, table_sizes=SMALL, top1_share=target, seed=7)
    rows = SyntheticGenerator(spec).rows(0, spec.rows)
    assert abs(empirical_top1(rows.sparse, SMALL) - target) < 0.02
    assert all(rows.sparse[:, t].max() < n for t, n in enumerate(SMALL)) and rows.sparse.min() >= 0


@pytest.mark.slow
def test_sampled_top1_share_full_criteo_sizes() -> None:
    spec = DataSpec(format="synthetic", rows=1_000_000, seed=1)
    rows = SyntheticGenerator(spec).rows(0, spec.rows)
    assert abs(empirical_top1(rows.sparse, CRITEO_KAGGLE_SIZES) - 0.92) < 0.02


def test_chunks_are_a_function_of_seed_and_index() -> None:
    spec = DataSpec(format="synthetic", rows=10 * CHUNK_ROWS, table_sizes=(1000, 5000), seed=3)
    a, b = SyntheticGenerator(spec), SyntheticGenerator(spec)
    late = b.chunk(7)  # generated first, without chunks 0..6
    for i in (0, 7):
        x, y = a.chunk(i), (late if i == 7 else b.chunk(i))
        np.testing.assert_array_equal(x.sparse, y.sparse)
        np.testing.assert_array_equal(x.dense, y.dense)
        np.testing.assert_array_equal(x.labels, y.labels)
    other = SyntheticGenerator(DataSpec(format="synthetic", rows=spec.rows, table_sizes=(1000, 5000), seed=4))
    assert not np.array_equal(other.chunk(0).sparse, a.chunk(0).sparse)
    assert a.chunk(0).dense.shape == (CHUNK_ROWS, 13) and len(a.chunk(10).labels) == 0


def test_click_rate_and_learnable_labels() -> None:
    spec = DataSpec(format="synthetic", rows=200_000, table_sizes=(100, 1000, 10_000, 50, 7, 300), click_rate=0.1)
    gen = SyntheticGenerator(spec)
    rows = gen.rows(0, spec.rows)
    assert abs(rows.labels.mean() - 0.1) < 0.01
    z = gen.logits(rows.dense, rows.sparse)
    clicked = rows.labels == 1
    # AUC of the true log-odds, by the rank-sum formula: well above chance.
    ranks = np.argsort(np.argsort(z)) + 1
    n1, n0 = clicked.sum(), (~clicked).sum()
    auc = (ranks[clicked].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)
    assert auc > 0.7


def test_drift_moves_the_hot_set() -> None:
    def hottest(drift: float, chunk: int) -> int:
        spec = DataSpec(format="synthetic", rows=40 * CHUNK_ROWS, table_sizes=(1000,), drift=drift)
        return int(np.bincount(SyntheticGenerator(spec).chunk(chunk).sparse[:, 0]).argmax())

    assert hottest(0.0, 0) == hottest(0.0, 30)
    assert hottest(1.0, 0) != hottest(1.0, 30)


def test_written_copy_trains_on_the_same_rows(tmp_path) -> None:
    spec = DataSpec(format="synthetic", rows=CHUNK_ROWS + 500, table_sizes=(100, 1000, 50_000), seed=4, eval_fraction=0.1)
    manifest = write_synthetic(spec, tmp_path / "syn")
    assert manifest.config == synthetic_config(spec) and manifest.rows == spec.rows
    live = open_dataset(spec)
    copy = open_dataset(DataSpec(format="preprocessed", path=str(tmp_path / "syn"), eval_fraction=0.1))
    assert copy.table_sizes == live.table_sizes and copy.num_train_rows == live.num_train_rows
    for a, b in zip(live.train_batches(700), copy.train_batches(700), strict=True):
        assert a.index == b.index
        for name in ("labels", "dense", "sparse"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
