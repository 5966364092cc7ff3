from __future__ import annotations

import numpy as np
import pytest

from common.data.dataset import open_dataset
from common.data.spec import DataSpec
from common.data.synthetic import CHUNK_ROWS
from common.errors import ConfigError


@pytest.fixture(scope="module")
def synth():
    return open_dataset(DataSpec(format="synthetic", rows=10_000, table_sizes=(100, 1000, 50_000), eval_fraction=0.25))


def test_batches_order_epochs_and_start(synth) -> None:
    assert synth.num_train_rows == 7500 and synth.num_batches(1000, epochs=3) == 21
    all_batches = list(synth.train_batches(1000, epochs=3))
    assert [b.index for b in all_batches] == list(range(21))
    np.testing.assert_array_equal(all_batches[7].sparse, all_batches[0].sparse)  # epoch 2 restarts
    resumed = list(synth.train_batches(1000, epochs=3, start=12))
    assert [b.index for b in resumed] == list(range(12, 21))
    for a, b in zip(resumed, all_batches[12:], strict=True):
        np.testing.assert_array_equal(a.sparse, b.sparse)
        np.testing.assert_array_equal(a.labels, b.labels)
    assert list(synth.train_batches(1000, start=99)) == []


def test_eval_rows_are_the_tail(synth) -> None:
    evals = list(synth.eval_batches(1000))
    assert [len(b.labels) for b in evals] == [1000, 1000, 500]
    np.testing.assert_array_equal(np.concatenate([b.dense for b in evals]), synth.rows(7500, 10_000).dense)


def test_batch_across_chunk_boundary() -> None:
    data = open_dataset(DataSpec(format="synthetic", rows=3 * CHUNK_ROWS, table_sizes=(1000,), seed=4))
    b = next(data.train_batches(1000, start=CHUNK_ROWS // 1000))
    start = (CHUNK_ROWS // 1000) * 1000
    assert start < CHUNK_ROWS < start + 1000
    np.testing.assert_array_equal(b.sparse, data.generator.rows(start, start + 1000).sparse)


def test_bad_batch_size(synth) -> None:
    with pytest.raises(ConfigError):
        synth.num_batches(0)
