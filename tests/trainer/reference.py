"""Single-process reference trainer: the executable definition of exact synchronous training.

Full embedding tables live in memory as one float32 ``[total_rows, d]`` tensor (every row at
its `common.init.initial_rows` value) with the row-wise optimizer state beside it. Each
global batch is trained as docs/design.md#exact-arithmetic defines: gather rows by key, forward, BCE-with-logits
loss averaged over the global batch, backward, one dense optimizer step, and one row-wise
embedding optimizer step per unique key of the batch with the sum of its per-use gradients.
Rows a batch does not use are not stepped.

With `slices` = T > 1 it is the *data-parallel* reference: the same global step computed as
T trainers compute it. Each contiguous slice of B/T samples is forwarded and backpropagated
on its own (its loss the mean over the slice); the dense gradients are combined as DDP does
(each scaled by 1/T, then summed) and each row's embedding gradients are summed over the
slices in rank order and divided by T, as `trainer.collectives.Collectives.sum_rows` does.
One forward over the global batch rounds differently, and training amplifies the difference
(docs/design.md#verification), so only this form can be compared bit for bit with a cluster.

torch runs on one thread here (`reference_train` sets it): its intra-op threads split
reductions into chunks whose partial sums depend on the thread count, so the reference
would not even agree with itself across machines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common.init import initial_rows
from common.keys import TableLayout
from trainer.models import ModelSpec, build_model
from trainer.optim import OptimizerSpec, build_dense_optimizer, build_embedding_optimizer

# (labels float32 [B], dense float32 [B, num_dense], keys int64 [B, num_tables] global keys)
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ReferenceResult:
    dense_state: dict[str, torch.Tensor]  # the model's state_dict after the last step
    table: torch.Tensor  # (total_rows, d) float32
    state: torch.Tensor  # (total_rows, state_width) float32 embedding optimizer state
    losses: tuple[float, ...]  # the loss of each iteration, before its update


class ReferenceTrainer:
    """Trains step by step; `table`, `state` and `model` may be read between steps.

    The dense model is built right after ``torch.manual_seed(seed)``; the table holds
    ``initial_rows(layout, seed, key, d)`` for every key.
    """

    def __init__(
        self,
        model_spec: ModelSpec,
        optimizer_spec: OptimizerSpec,
        layout: TableLayout,
        seed: int,
        num_dense: int,
    ) -> None:
        self.layout = layout
        torch.manual_seed(seed)
        self.model = build_model(model_spec, num_dense, layout.num_tables)
        self.dense_optimizer = build_dense_optimizer(optimizer_spec, self.model.parameters())
        self.embedding_optimizer = build_embedding_optimizer(optimizer_spec)
        all_keys = np.arange(layout.total_rows, dtype=np.int64)
        self.table = torch.from_numpy(
            initial_rows(layout, seed, all_keys, model_spec.embedding_dim)
        )  # (total_rows, d)
        self.state = self.embedding_optimizer.initial_state(layout.total_rows)

    def step(self, labels: torch.Tensor, dense: torch.Tensor, keys: torch.Tensor, slices: int = 1) -> float:
        """Train on one global batch as `slices` trainers would; returns its loss (the mean
        of the slices' losses) before the update."""
        self.layout.check_keys(keys.numpy())
        unique = torch.unique(keys)  # (U,)
        params = list(self.model.parameters())
        dense_grad = [torch.zeros_like(p) for p in params]
        row_grad = torch.zeros(len(unique), self.table.shape[1])  # (U, d)
        per = len(labels) // slices
        losses = []
        for r in range(slices):
            part = slice(r * per, (r + 1) * per)
            loss, grads, slice_keys, slice_grad = self.slice_gradients(labels[part], dense[part], keys[part])
            losses.append(loss)
            for total, g in zip(dense_grad, grads):
                total.add_(g * (1.0 / slices))  # DDP scales each gradient, then sums
            row_grad[torch.searchsorted(unique, slice_keys)] += slice_grad
        for p, g in zip(params, dense_grad):
            p.grad = g
        self.dense_optimizer.step()
        self.embedding_optimizer.step_at(self.table, self.state, unique, row_grad / slices)
        return sum(losses) / slices

    def slice_gradients(
        self, labels: torch.Tensor, dense: torch.Tensor, keys: torch.Tensor
    ) -> tuple[float, list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(loss, dense gradients, unique keys, their gradients) of one slice's mean loss."""
        unique, inverse = torch.unique(keys, return_inverse=True)  # (u,), (b, F)
        # One leaf per unique row: indexing it by `inverse` makes autograd sum the
        # gradients of every use of a row, as embedding_bag's backward does.
        rows = self.table[unique].requires_grad_(True)  # (u, d)
        logits = self.model(dense, rows[inverse])  # (b, F, d) -> (b,)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        assert rows.grad is not None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        return float(loss.detach()), grads, unique, rows.grad


def reference_train(
    model_spec: ModelSpec,
    optimizer_spec: OptimizerSpec,
    layout: TableLayout,
    seed: int,
    batches: Iterable[Batch],
    num_dense: int,
    slices: int | Callable[[int], int] = 1,
) -> ReferenceResult:
    """Train on every batch of `batches` in order (on one torch thread, as `slices`
    trainers would: a count, or the count of each iteration, for a run resumed with another
    number of trainers) and return the final parameters."""
    torch.set_num_threads(1)
    trainer = ReferenceTrainer(model_spec, optimizer_spec, layout, seed, num_dense)
    count = slices if callable(slices) else (lambda _: slices)
    losses = tuple(trainer.step(*batch, slices=count(x)) for x, batch in enumerate(batches))
    return ReferenceResult(
        dense_state={k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        table=trainer.table,
        state=trainer.state,
        losses=losses,
    )
