"""A model of your own, in the spec as ``[model] factory = "examples.my_model:build"``.

One self-attention layer over the feature vectors, AutoInt-style (Song et al., 2019): the
dense features are projected to one more d-dim vector, every vector attends to every
other, and an MLP of `deep_mlp` widths reads the result. It shows the whole interface:

* `build(spec, num_dense, num_tables)` returns an `nn.Module`; `spec` is the `[model]`
  section (`embedding_dim`, `deep_mlp`, ...: any field may be used);
* ``forward(dense (B, num_dense), emb (B, num_tables, embedding_dim)) -> (B,)`` float32
  logits; the embedding rows arrive already looked up (they live in the PS and the
  trainers' caches, not in the module);
* parameters come from torch's global generator, which every trainer seeds alike.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model_spec import ModelSpec
from trainer.models.layers import logit_head

HEADS = 2


class FeatureAttention(nn.Module):
    """logit = mlp(flatten(LayerNorm(x + attention(x)))), x = [proj(dense), e_1, ..., e_F]."""

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        d = spec.embedding_dim
        self.dense = nn.Linear(num_dense, d) if num_dense else None  # Avazu has no dense features
        vectors = num_tables + (1 if self.dense is not None else 0)
        self.attention = nn.MultiheadAttention(d, HEADS, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = logit_head(vectors * d, spec.deep_mlp)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = emb  # (B, F, d)
        if self.dense is not None:
            x = torch.cat([self.dense(dense).unsqueeze(1), emb], dim=1)  # (B, 1 + F, d)
        attended, _ = self.attention(x, x, x, need_weights=False)  # (B, V, d)
        z = self.norm(x + attended).flatten(1)  # (B, V d)
        return self.head(z).squeeze(-1)  # (B,)


def build(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    if spec.embedding_dim % HEADS:
        raise ValueError(f"embedding_dim {spec.embedding_dim} must be a multiple of {HEADS} heads")
    return FeatureAttention(spec, num_dense, num_tables)
