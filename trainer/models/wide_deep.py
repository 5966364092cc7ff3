"""Wide & Deep (Cheng et al., 2016): a wide linear part plus a deep MLP."""

from __future__ import annotations

import torch
from torch import nn

from common.model_spec import ModelSpec
from trainer.models.layers import logit_head


class WideDeep(nn.Module):
    """logit = wide([dense, e_1..e_F]) + deep([dense, e_1..e_F]).

    The paper's wide part is linear over sparse (cross-product) features; here it is linear
    over the dense features and the looked-up embeddings, so all sparse parameters stay in
    the shared d-dim tables, as in our DeepFM.
    """

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        flat = num_dense + num_tables * spec.embedding_dim
        self.wide = nn.Linear(flat, 1)
        self.deep = logit_head(flat, spec.deep_mlp)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, emb.flatten(1)], dim=1)  # (B, num_dense + F d)
        return (self.wide(x) + self.deep(x)).squeeze(-1)  # (B,)
