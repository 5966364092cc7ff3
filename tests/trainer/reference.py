"""Single-process reference trainer: the executable definition of exact synchronous training.

Full embedding tables live in memory as one float32 ``[total_rows, d]`` tensor (every row at
its `common.init.initial_rows` value) with the row-wise optimizer state beside it. Each
global batch is trained as DESIGN §5 defines: gather rows by key, forward, BCE-with-logits
loss averaged over the global batch, backward, one dense optimizer step, and one row-wise
embedding optimizer step per unique key of the batch with the sum of its per-use gradients.
Rows a batch does not use are not stepped. A distributed run on the same specs, seed and
batches must end with the same parameters within 1e-5 relative.
"""

from __future__ import annotations

from collections.abc import Iterable
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

    def step(self, labels: torch.Tensor, dense: torch.Tensor, keys: torch.Tensor) -> float:
        """Train on one global batch; returns its loss before the update."""
        self.layout.check_keys(keys.numpy())
        unique, inverse = torch.unique(keys, return_inverse=True)  # (U,), (B, F)
        # One leaf per unique row: indexing it by `inverse` makes autograd sum the
        # gradients of every use of a row, as embedding_bag's backward does.
        rows = self.table[unique].requires_grad_(True)  # (U, d)
        logits = self.model(dense, rows[inverse])  # (B, F, d) -> (B,)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.dense_optimizer.step()
        assert rows.grad is not None
        self.embedding_optimizer.step_at(self.table, self.state, unique, rows.grad)
        return float(loss.detach())


def reference_train(
    model_spec: ModelSpec,
    optimizer_spec: OptimizerSpec,
    layout: TableLayout,
    seed: int,
    batches: Iterable[Batch],
    num_dense: int,
) -> ReferenceResult:
    """Train on every batch of `batches` in order and return the final parameters."""
    trainer = ReferenceTrainer(model_spec, optimizer_spec, layout, seed, num_dense)
    losses = tuple(trainer.step(*batch) for batch in batches)
    return ReferenceResult(
        dense_state={k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        table=trainer.table,
        state=trainer.state,
        losses=losses,
    )
