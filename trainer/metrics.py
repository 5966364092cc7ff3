"""Evaluation metrics for click-through prediction: ROC AUC and log loss (scikit-learn)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import log_loss, roc_auc_score

ArrayLike = np.ndarray | torch.Tensor


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Metrics over `count` examples, `positives` of them with label 1.

    `auc` is NaN when the labels hold one class only (ROC AUC is undefined then); both
    metrics are NaN when there are no examples.
    """

    auc: float
    log_loss: float
    count: int
    positives: int


def evaluate(labels: ArrayLike, probs: ArrayLike) -> EvalResult:
    """AUC and mean log loss of predicted click probabilities `probs` against 0/1 `labels`.

    Both are 1-D of the same length; tensors may live on any device. Probabilities are
    clipped away from 0 and 1 by scikit-learn before the logarithm.
    """
    y = _to_numpy(labels).astype(np.float64).ravel()
    p = _to_numpy(probs).astype(np.float64).ravel()
    if y.shape != p.shape:
        raise ValueError(f"labels {y.shape} and probs {p.shape} differ in length")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    count, positives = int(y.size), int(y.sum())
    if count == 0:
        return EvalResult(auc=math.nan, log_loss=math.nan, count=0, positives=0)
    # Checked here, not left to scikit-learn, which would warn and may change its answer.
    auc = float(roc_auc_score(y, p)) if 0 < positives < count else math.nan
    loss = float(log_loss(y, p, labels=[0.0, 1.0]))
    return EvalResult(auc=auc, log_loss=loss, count=count, positives=positives)


class MetricAccumulator:
    """Collects labels and probabilities over eval batches; `result()` scores them all.

    AUC is not a mean of per-batch values, so every prediction is kept (on the CPU) until
    `result()`: 8 bytes a sample with float32 inputs, copied into arrays of their own. A
    view would keep what it views alive: a step's labels view its whole batch message, 14
    times their size with Criteo's 13 dense features.
    """

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._probs: list[np.ndarray] = []

    def add(self, labels: ArrayLike, probs: ArrayLike) -> None:
        """Record one batch: 1-D `labels` (0/1) and predicted probabilities of equal length."""
        y, p = _to_numpy(labels).ravel(), _to_numpy(probs).ravel()
        if y.shape != p.shape:
            raise ValueError(f"labels {y.shape} and probs {p.shape} differ in length")
        self._labels.append(y.copy())
        self._probs.append(p.copy())

    @property
    def count(self) -> int:
        return sum(len(y) for y in self._labels)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every label and probability recorded so far, in order (to gather across ranks)."""
        if not self._labels:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(self._labels), np.concatenate(self._probs)

    def result(self) -> EvalResult:
        return evaluate(*self.arrays())


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x)
