"""The `[optimizer]` section: parsing, the row state it implies, and the errors that name a
bad field."""

from __future__ import annotations

import math

import pytest

from common.errors import ConfigError
from common.optimizer_spec import OptimizerSpec, parse_optimizer_spec


def test_row_state_follows_the_embedding_optimizer() -> None:
    assert (OptimizerSpec().state_width, OptimizerSpec(initial_accumulator=0.5).state_init) == (0, 0.0)
    adagrad = OptimizerSpec(embedding="rowwise_adagrad", initial_accumulator=0.5)
    assert (adagrad.state_width, adagrad.state_init) == (1, 0.5)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"embedding": "adam"}, "optimizer.embedding"),
        ({"dense": "rowwise_adagrad"}, "optimizer.dense"),
        ({"embedding_lr": 0}, "optimizer.embedding_lr"),
        ({"dense_lr": "0.1"}, "optimizer.dense_lr"),
        ({"dense_lr": math.inf}, "optimizer.dense_lr"),
        ({"eps": True}, "optimizer.eps"),
        ({"initial_accumulator": -1.0}, "optimizer.initial_accumulator"),
        ({"lr": 0.1}, "optimizer.lr"),
    ],
)
def test_bad_fields_raise_config_error_naming_them(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_optimizer_spec(section)
    assert info.value.field == field
