from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch

from trainer.evaluation import MetricAccumulator, evaluate, log_loss, roc_auc


def test_auc_and_log_loss_by_hand() -> None:
    labels = np.array([0, 0, 1, 1])
    probs = np.array([0.1, 0.6, 0.4, 0.9])
    result = evaluate(labels, probs)
    # Of the 4 (positive, negative) pairs, (0.4, 0.6) is the only one ranked wrongly.
    assert result.auc == pytest.approx(0.75)
    expected_loss = -(math.log(0.9) + math.log(0.4) + math.log(0.4) + math.log(0.9)) / 4
    assert result.log_loss == pytest.approx(expected_loss)
    assert (result.count, result.positives) == (4, 2)


def test_one_class_gives_nan_auc_but_a_log_loss() -> None:
    result = evaluate(torch.ones(3), torch.tensor([0.5, 0.25, 0.5]))
    assert math.isnan(result.auc)
    assert result.log_loss == pytest.approx(-(2 * math.log(0.5) + math.log(0.25)) / 3)
    assert (result.count, result.positives) == (3, 3)


def test_no_examples_gives_nan_for_both() -> None:
    result = MetricAccumulator().result()
    assert math.isnan(result.auc) and math.isnan(result.log_loss) and result.count == 0


def test_accumulator_scores_all_batches_together() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random(100) < 0.3).astype(np.float32)
    probs = rng.random(100).astype(np.float32)
    acc = MetricAccumulator()
    for start in range(0, 100, 32):  # batches of 32, 32, 32, 4
        batch = slice(start, start + 32)
        acc.add(torch.from_numpy(labels[batch]), torch.from_numpy(probs[batch]))
    assert acc.count == 100
    assert acc.result() == evaluate(labels, probs)


def test_accumulator_keeps_no_batch_message_alive() -> None:
    # A step's labels are a view of its decoded batch message (labels and dense features):
    # kept as they are for progressive AUC, each would pin its whole message.
    message = np.zeros(14 * 256, dtype=np.float32)
    alive = weakref.ref(message)
    acc = MetricAccumulator()
    acc.add(message[:256], np.full(256, 0.5, dtype=np.float32))
    del message
    gc.collect()
    assert alive() is None
    assert acc.count == 256


def test_rejects_mismatched_or_non_binary_input() -> None:
    with pytest.raises(ValueError, match="differ"):
        MetricAccumulator().add(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="0 or 1"):
        evaluate(np.array([0.0, 2.0]), np.array([0.5, 0.5]))


def test_auc_is_the_share_of_correctly_ordered_pairs_ties_counting_half() -> None:
    rng = np.random.default_rng(3)
    labels = (rng.random(300) < 0.4).astype(np.float64)
    scores = rng.integers(0, 20, 300) / 20.0  # many ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(labels, scores) == pytest.approx(pairs / (pos.size * neg.size), rel=1e-12)


def test_log_loss_clips_certain_predictions() -> None:
    # A sure but wrong prediction costs -log(eps), not infinity.
    loss = log_loss(np.array([1.0, 0.0]), np.array([0.0, 0.0]))
    assert loss == pytest.approx(-math.log(np.finfo(np.float64).eps) / 2)
