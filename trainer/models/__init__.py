"""Recommendation models as plain `nn.Module`s (no torch.distributed here).

Every model maps ``forward(dense (B, num_dense) float32, emb (B, F, d) float32) -> (B,)``
logits, where `emb` holds the already-looked-up embedding row of each of the F categorical
features (one per table). The embedding tables themselves live outside the model (PS, cache,
or a reference table), so `model.parameters()` are exactly the dense, DDP-replicated ones.
A model of your own follows the same interface (`trainer.models.factory`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from common.errors import ConfigError
from common.model_spec import ModelSpec
from trainer.models.dcn import DCN
from trainer.models.deepfm import DeepFM
from trainer.models.dlrm import DLRM
from trainer.models.factory import build_from_factory
from trainer.models.wide_deep import WideDeep

__all__ = [
    "DCN",
    "DLRM",
    "DeepFM",
    "ModelSpec",
    "WideDeep",
    "build_model",
]

_MODELS: dict[str, Callable[[ModelSpec, int, int], nn.Module]] = {
    "dlrm": DLRM,
    "deepfm": DeepFM,
    "wide_deep": WideDeep,
    "dcn": DCN,
}


def build_model(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    """The model `spec` names, for `num_dense` dense and `num_tables` categorical features:
    a built-in one, or what ``spec.factory(spec, num_dense, num_tables)`` returns (checked
    on a probe batch, `trainer.models.factory`).

    Parameters are drawn from torch's global generator with PyTorch's default `nn.Linear`
    init, in a fixed construction order: the caller seeds it (``torch.manual_seed(seed)``)
    right before this call, so every trainer and the reference build identical models. A
    factory must draw its parameters from that generator too.
    """
    if type(num_dense) is not int or num_dense < 0:
        raise ConfigError("data.num_dense", f"must be an integer >= 0, got {num_dense!r}")
    if type(num_tables) is not int or num_tables <= 0:
        raise ConfigError("data.num_tables", f"must be a positive integer, got {num_tables!r}")
    if spec.name == "dlrm" and num_dense == 0 and num_tables < 2:
        # Without dense input DLRM's only features are pairwise dots of the embeddings.
        raise ConfigError("data.num_tables", "DLRM without dense features needs at least 2 tables")
    if spec.factory is not None:
        return build_from_factory(spec, num_dense, num_tables)
    assert spec.name is not None  # ModelSpec holds a name or a factory
    return _MODELS[spec.name](spec, num_dense, num_tables)
