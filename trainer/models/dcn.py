"""DCN v2 (Wang et al., 2021), stacked: full-rank cross layers, then a deep MLP."""

from __future__ import annotations

import torch
from torch import nn

from common.model_spec import ModelSpec
from trainer.models.layers import logit_head


class CrossLayer(nn.Module):
    """``x_{l+1} = x0 * (W x_l + b) + x_l`` with a full-rank ``W`` of shape ``(D, D)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.linear(x) + x  # (B, D)


class DCN(nn.Module):
    """logit = deep(cross_L(…cross_1(x0))) with ``x0 = [dense, e_1..e_F]``.

    With `cross_layers == 0` this is a plain MLP over x0; with an empty `deep_mlp` the
    cross output goes straight to the final ``Linear(D, 1)``.
    """

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        width = num_dense + num_tables * spec.embedding_dim
        self.cross = nn.ModuleList(CrossLayer(width) for _ in range(spec.cross_layers))
        self.deep = logit_head(width, spec.deep_mlp)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, emb.flatten(1)], dim=1)  # (B, D) with D = num_dense + F d
        x = x0
        for layer in self.cross:
            x = layer(x0, x)  # (B, D)
        return self.deep(x).squeeze(-1)  # (B,)
