"""DLRM (Naumov et al., 2019): bottom MLP, pairwise dot interaction, top MLP."""

from __future__ import annotations

import torch
from torch import nn

from common.model_spec import ModelSpec
from trainer.models.layers import MLP, logit_head


def pairwise_dots(vectors: torch.Tensor) -> torch.Tensor:
    """Dot product of every pair ``i < j`` of the n vectors: ``(B, n, d) -> (B, n(n-1)/2)``.

    Pairs are in row-major upper-triangle order (0,1), (0,2), …, (1,2), …; no self pairs.
    """
    n = vectors.shape[1]
    gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, n, n)
    rows, cols = torch.triu_indices(n, n, offset=1, device=vectors.device)
    return gram[:, rows, cols]  # (B, n(n-1)/2)


class DLRM(nn.Module):
    """logit = top([bottom(dense), pairwise_dots(bottom(dense), e_1..e_F)]).

    With `num_dense == 0` (e.g. Avazu) there is no bottom MLP: the interaction is over the F
    embeddings only and the top MLP sees just their pairwise dots, so at least two
    categorical features are needed then.
    """

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        self.bottom = MLP(num_dense, spec.bottom_mlp, final_relu=True) if num_dense > 0 else None
        num_vectors = num_tables + (1 if self.bottom is not None else 0)
        num_pairs = num_vectors * (num_vectors - 1) // 2
        top_in = num_pairs + (spec.embedding_dim if self.bottom is not None else 0)
        self.top = logit_head(top_in, spec.top_mlp)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.bottom is None:
            return self.top(pairwise_dots(emb)).squeeze(-1)  # (B,)
        x = self.bottom(dense)  # (B, d)
        vectors = torch.cat([x.unsqueeze(1), emb], dim=1)  # (B, 1 + F, d)
        z = torch.cat([x, pairwise_dots(vectors)], dim=1)  # (B, d + (F+1)F/2)
        return self.top(z).squeeze(-1)  # (B,)
