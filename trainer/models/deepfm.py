"""DeepFM (Guo et al., 2017): first-order term + FM second-order term + deep MLP."""

from __future__ import annotations

import torch
from torch import nn

from common.model_spec import ModelSpec
from trainer.models.layers import logit_head


def fm_second_order(emb: torch.Tensor) -> torch.Tensor:
    """Sum over pairs ``i < j`` of ``<e_i, e_j>``: ``(B, F, d) -> (B,)``.

    Uses the O(F d) identity ``½ Σ_k ((Σ_i e_ik)² − Σ_i e_ik²)``.
    """
    square_of_sum = emb.sum(dim=1).pow(2)  # (B, d)
    sum_of_squares = emb.pow(2).sum(dim=1)  # (B, d)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)  # (B,)


class DeepFM(nn.Module):
    """logit = first_order + fm_second_order(e) + deep([dense, e_1..e_F]).

    The paper gives each categorical value its own scalar first-order weight, which would be
    a second set of sparse tables. Here the first-order term is instead a learned linear
    projection of each feature's d-dim embedding (``Σ_f <w_f, e_f>``, plus a linear term of
    the dense features and a bias), so every sparse parameter stays in the shared d-dim
    tables: one cache, one row-wise optimizer, one key space. Dense features enter the
    first-order term and the deep MLP; they have no embedding, so not the FM term.
    """

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        flat = num_dense + num_tables * spec.embedding_dim
        self.first_order = nn.Linear(flat, 1)  # the per-feature projections w_f, side by side
        self.deep = logit_head(flat, spec.deep_mlp)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, emb.flatten(1)], dim=1)  # (B, num_dense + F d)
        first = self.first_order(x).squeeze(-1)  # (B,)
        deep = self.deep(x).squeeze(-1)  # (B,)
        return first + fm_second_order(emb) + deep  # (B,)
