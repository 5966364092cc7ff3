"""Building blocks shared by the models."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers of the given output widths with ReLU between them.

    `final_relu` says whether the last layer is followed by a ReLU too (DLRM's bottom MLP
    is; a layer that produces a logit is not). With no widths the module is the identity.
    """

    def __init__(self, in_features: int, widths: tuple[int, ...], *, final_relu: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, width in enumerate(widths):
            layers.append(nn.Linear(in_features, width))
            if final_relu or i < len(widths) - 1:
                layers.append(nn.ReLU())
            in_features = width
        self.net = nn.Sequential(*layers)
        self.out_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def logit_head(in_features: int, hidden: tuple[int, ...]) -> MLP:
    """ReLU layers of widths `hidden`, then a plain ``Linear(·, 1)``: ``(B, in) -> (B, 1)``."""
    return MLP(in_features, (*hidden, 1), final_relu=False)
