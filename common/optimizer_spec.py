"""The `[optimizer]` section of a cluster spec: which optimizers, their rates and constants.

Pure configuration, read by every role through the job: the PS sizes each row's optimizer
state from it, the trainers build their torch optimizers from it (`trainer/optim.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from common.errors import ConfigError

EmbeddingOptimizerName = Literal["sgd", "rowwise_adagrad"]
DenseOptimizerName = Literal["sgd", "adagrad"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The `[optimizer]` section.

    `eps` and `initial_accumulator` apply to whichever of the two optimizers is Adagrad.
    """

    embedding: EmbeddingOptimizerName = "sgd"
    embedding_lr: float = 0.01
    dense: DenseOptimizerName = "sgd"
    dense_lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("optimizer.embedding", self.embedding, get_args(EmbeddingOptimizerName))
        _check_choice("optimizer.dense", self.dense, get_args(DenseOptimizerName))
        _check_number("optimizer.embedding_lr", self.embedding_lr, positive=True)
        _check_number("optimizer.dense_lr", self.dense_lr, positive=True)
        _check_number("optimizer.eps", self.eps, positive=True)
        _check_number("optimizer.initial_accumulator", self.initial_accumulator, positive=False)

    @property
    def state_width(self) -> int:
        """Float32 state values the embedding optimizer keeps per row: none for SGD, row-wise
        Adagrad's accumulator otherwise."""
        return 0 if self.embedding == "sgd" else 1

    @property
    def state_init(self) -> float:
        """The optimizer state of a row never updated (Adagrad's initial accumulator)."""
        return self.initial_accumulator if self.state_width else 0.0

    @property
    def state_min(self) -> float | None:
        """The least value a row's state may hold: row-wise Adagrad's accumulator is a sum of
        squares (the trainer takes its square root), so 0; None without state."""
        return 0.0 if self.state_width else None


def parse_optimizer_spec(section: dict[str, Any]) -> OptimizerSpec:
    """Build an `OptimizerSpec` from a parsed TOML `[optimizer]` table (every key optional).

    An unknown key or a bad value raises `ConfigError` naming the field.
    """
    known = {f.name for f in fields(OptimizerSpec)}
    for key in section:
        if key not in known:
            raise ConfigError(
                f"optimizer.{key}", f"unknown field; known fields are {sorted(known)}"
            )
    return OptimizerSpec(**section)


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"must be one of {list(choices)}, got {value!r}")


def _check_number(field: str, value: object, *, positive: bool) -> None:
    # bool is an int subclass; `true` in a TOML file is never meant as a rate.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(field, f"must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ConfigError(field, f"must be >= 0, got {value!r}")
