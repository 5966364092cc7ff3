"""The `[model]` section of a cluster spec: which model and its sizes.

MLP widths follow one convention: `bottom_mlp` lists the output width of every bottom layer
(its input is the `num_dense` dense features, so DLRM's "13-512-256-64-16" is
``bottom_mlp = [512, 256, 64, 16]``); `top_mlp` and `deep_mlp` list hidden widths only, and
each model appends the final ``Linear(·, 1)`` that produces the logit (DLRM's "512-256-1" is
``top_mlp = [512, 256]``).

Instead of a built-in `name`, `factory = "package.module:function"` names a function that
builds the model (`trainer.models.build_model` documents its interface). Only the string's
form is checked here: importing and probing the model is the trainer's business, since the
PS and oracle never build it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from common.errors import ConfigError

ModelName = Literal["dlrm", "deepfm", "wide_deep", "dcn"]
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)
# A dotted module path, a colon, then a dotted attribute path within that module.
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
FACTORY_FORM = re.compile(rf"(?P<module>{_DOTTED}):(?P<attribute>{_DOTTED})")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model to build and its sizes; defaults are DLRM's Criteo Kaggle configuration.

    Exactly one of `name` (a built-in model) and `factory` (``"package.module:function"``,
    a model of your own) is set. Fields a model does not use are ignored (e.g.
    `cross_layers` outside DCN); a factory receives them all. For DLRM the last `bottom_mlp`
    width must equal `embedding_dim`, since the bottom output takes part in the dot-product
    interaction with the embeddings.
    """

    name: ModelName | None = None
    factory: str | None = None
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)  # DLRM only
    top_mlp: tuple[int, ...] = (512, 256)  # DLRM only
    deep_mlp: tuple[int, ...] = (512, 256, 64)  # DeepFM, Wide&Deep, DCN
    cross_layers: int = 3  # DCN only

    def __post_init__(self) -> None:
        self._check_name_or_factory()
        _check_positive_int("model.embedding_dim", self.embedding_dim)
        _check_widths("model.bottom_mlp", self.bottom_mlp)
        _check_widths("model.top_mlp", self.top_mlp)
        _check_widths("model.deep_mlp", self.deep_mlp)
        if type(self.cross_layers) is not int or self.cross_layers < 0:
            raise ConfigError(
                "model.cross_layers", f"must be an integer >= 0, got {self.cross_layers!r}"
            )
        if self.name == "dlrm":
            if not self.bottom_mlp:
                raise ConfigError("model.bottom_mlp", "DLRM needs at least one bottom layer")
            if self.bottom_mlp[-1] != self.embedding_dim:
                raise ConfigError(
                    "model.bottom_mlp",
                    f"last width {self.bottom_mlp[-1]} must equal "
                    f"embedding_dim {self.embedding_dim}",
                )

    def _check_name_or_factory(self) -> None:
        if self.factory is None:
            if self.name not in MODEL_NAMES:
                raise ConfigError(
                    "model.name", f"must be one of {list(MODEL_NAMES)}, got {self.name!r}"
                )
            return
        if self.name is not None:
            raise ConfigError(
                "model.factory",
                f"and name = {self.name!r} are both set: give name for a built-in model, "
                "factory for your own",
            )
        if not isinstance(self.factory, str) or not FACTORY_FORM.fullmatch(self.factory):
            raise ConfigError(
                "model.factory",
                f"must be 'package.module:function', got {self.factory!r}",
            )


def parse_model_spec(section: dict[str, Any]) -> ModelSpec:
    """Build a `ModelSpec` from a parsed TOML `[model]` table.

    Lists become tuples; an unknown key, neither `name` nor `factory`, or a bad value raises
    `ConfigError` naming the field (``model.<field>``).
    """
    known = {f.name for f in fields(ModelSpec)}
    for key in section:
        if key not in known:
            raise ConfigError(f"model.{key}", f"unknown field; known fields are {sorted(known)}")
    if "name" not in section and "factory" not in section:
        raise ConfigError("model.name", "is required (or a factory of your own)")
    values = dict(section)
    for key in ("bottom_mlp", "top_mlp", "deep_mlp"):
        if key in values:
            if not isinstance(values[key], (list, tuple)):
                raise ConfigError(f"model.{key}", f"must be a list of widths, got {values[key]!r}")
            values[key] = tuple(values[key])
    return ModelSpec(**values)


def _check_positive_int(field: str, value: object) -> None:
    # bool is an int subclass; `true` in a TOML file is never meant as a size.
    if type(value) is not int or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")


def _check_widths(field: str, widths: object) -> None:
    if not isinstance(widths, tuple):
        raise ConfigError(field, f"must be a tuple of widths, got {widths!r}")
    for i, width in enumerate(widths):
        _check_positive_int(f"{field}[{i}]", width)
