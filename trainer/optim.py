"""Row-wise embedding optimizers and the dense optimizer factory (docs/design.md#exact-arithmetic), built from the
`[optimizer]` section (`common/optimizer_spec.py`).

An embedding optimizer updates a set of rows from their gradients, each row on its own:
whoever holds a row (a trainer's cache, the reference trainer) applies the same arithmetic,
so every holder ends with the same bits. Its per-row state is a plain float32 ``[n, s]``
tensor that travels with the row to the parameter server and back.

The gradient handed to `step` is the already-combined one: the sum of the row's per-use
gradients over the global batch of a loss that is the mean over that batch (with T trainers:
summed across trainers, divided by T). Rows not used in a batch are not stepped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from common.optimizer_spec import OptimizerSpec


class EmbeddingOptimizer(ABC):
    """Updates rows ``[n, d]`` and their state ``[n, state_width]`` in place from a gradient."""

    @property
    @abstractmethod
    def state_width(self) -> int:
        """Number of float32 state values kept per row."""

    def initial_state(self, n: int) -> torch.Tensor:
        """State of `n` rows never updated: ``[n, state_width]`` float32 on the CPU."""
        return torch.zeros(n, self.state_width, dtype=torch.float32)

    def step(self, rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one update to `rows` and `state` in place.

        They must be the caller's storage (or views of it): a fancy-indexed gather such as
        ``table[idx]`` is a copy, so gather, step, and scatter back (see `step_at`).
        """
        _check_shapes(rows, state, grad, self.state_width)
        self._update(rows, state, grad)

    def step_at(
        self, table: torch.Tensor, state: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, *,
        positions: torch.Tensor | None = None, divisor: int = 1,
    ) -> None:
        """Update rows ``table[index]`` and ``state[index]`` in place; `index` must be unique.
        Row ``index[i]``'s gradient is ``grad[positions[i]] / divisor`` (``grad[i] / divisor``
        without `positions`): the caller need not gather and divide first.

        A repeated index would be updated once with one of its gradients, never the sum:
        combine the gradients of a repeated row before calling.
        """
        if positions is not None:
            grad = grad.index_select(0, positions)
        if divisor != 1:
            grad = grad / divisor
        rows, row_state = table.index_select(0, index), state.index_select(0, index)
        self.step(rows, row_state, grad)
        table.index_copy_(0, index, rows)
        state.index_copy_(0, index, row_state)

    @abstractmethod
    def _update(self, rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SGD(EmbeddingOptimizer):
    """``rows -= lr * grad``; no state."""

    lr: float

    @property
    def state_width(self) -> int:
        return 0

    def _update(self, rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        rows.add_(grad, alpha=-self.lr)


@dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(EmbeddingOptimizer):
    """Row-wise Adagrad as TorchRec/FBGEMM's ``EXACT_ROWWISE_ADAGRAD``; one state value per row.

    ``acc += mean(grad², dim=1)`` (`mean_of_squares`, in a fixed order) then
    ``rows -= lr * grad / (sqrt(acc) + eps)``, with the accumulator starting at
    `initial_accumulator`.
    """

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    @property
    def state_width(self) -> int:
        return 1

    def initial_state(self, n: int) -> torch.Tensor:
        return torch.full((n, 1), self.initial_accumulator, dtype=torch.float32)

    def step_at(
        self, table: torch.Tensor, state: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, *,
        positions: torch.Tensor | None = None, divisor: int = 1,
    ) -> None:
        # On the CPU one fused pass (trainer/kernels.py), the same bits as the torch ops
        if not _fusable(table, state, index, grad, positions):
            super().step_at(table, state, index, grad, positions=positions, divisor=divisor)
            return
        from trainer.kernels import rowwise_adagrad_at  # numba: the trainers' zygote has imported it

        if not len(index):
            return
        # the kernel checks every shape and bound before it writes (ValueError, IndexError)
        rowwise_adagrad_at(table.numpy(), state.numpy(), index.numpy(), grad.numpy(),
                           _NO_POSITIONS if positions is None else positions.numpy(),
                           np.float32(divisor), np.float32(-self.lr), np.float32(self.eps))

    def _update(self, rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        state.add_(mean_of_squares(grad))  # (n, 1)
        rows.addcdiv_(grad, correctly_rounded_sqrt(state).add_(self.eps), value=-self.lr)


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The float32 root of each element, correctly rounded: float64's root (exact to half an
    ulp of float64, far inside half an ulp of float32) rounded to float32. torch's float32
    root on the CPU is not: MKL's is off by an ulp for about 0.6% of inputs, and a build
    without MKL, a GPU and the fused kernel (trainer/kernels.py) round correctly, so the
    same rows would end with other bits on other hosts."""
    return x.double().sqrt_().to(x.dtype)


_NO_POSITIONS = np.zeros(0, np.int64)


def _fusable(
    table: torch.Tensor, state: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, positions: torch.Tensor | None
) -> bool:
    """Whether `step_at` can run the fused CPU kernel on these tensors as they are."""
    floats = (table, state, grad)
    indices = (index,) if positions is None else (index, positions)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous() for t in floats)
        and all(t.device.type == "cpu" and t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous()
                for t in indices)
        and not any(t.requires_grad for t in floats)
        and table.shape[1] > 0 and state.shape[1] == 1
    )


def mean_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """Each row's mean of squares, ``[n, d] -> [n, 1]``, added in one fixed order: a pairwise
    tree over the columns made of elementwise adds, whatever n, the memory layout or the
    device. A reduction kernel's grouping may depend on them (on the CPU a transposed
    layout changes the last bit of ``square().mean(dim=1)``; on a GPU the launch shape, so
    the number of rows in the call), and modes step different sets of rows together."""
    level = grad.square()
    width = level.shape[1]
    while width > 1:
        half = width // 2
        paired = level[:, :half] + level[:, half : 2 * half]
        if width % 2:  # the odd column out joins the first pair
            paired[:, :1] += level[:, 2 * half :]
        level, width = paired, half
    return level.div_(grad.shape[1]) if grad.shape[1] else level


def _check_shapes(rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, width: int) -> None:
    if rows.dim() != 2 or grad.shape != rows.shape:
        raise ValueError(
            f"rows {tuple(rows.shape)} and grad {tuple(grad.shape)} must both be [n, d]"
        )
    if state.shape != (rows.shape[0], width):
        raise ValueError(f"state is {tuple(state.shape)}, expected ({rows.shape[0]}, {width})")
    for name, t in (("rows", rows), ("state", state), ("grad", grad)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")


def build_embedding_optimizer(spec: OptimizerSpec) -> EmbeddingOptimizer:
    if spec.embedding == "sgd":
        return SGD(lr=spec.embedding_lr)
    return RowWiseAdagrad(
        lr=spec.embedding_lr, eps=spec.eps, initial_accumulator=spec.initial_accumulator
    )


def build_dense_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """Plain ``torch.optim.SGD`` or ``torch.optim.Adagrad`` over the dense parameters."""
    if spec.dense == "sgd":
        return torch.optim.SGD(params, lr=spec.dense_lr)
    return torch.optim.Adagrad(
        params, lr=spec.dense_lr, eps=spec.eps, initial_accumulator_value=spec.initial_accumulator
    )
