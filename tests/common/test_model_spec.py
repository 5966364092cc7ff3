"""The `[model]` section: parsing, defaults and the errors that name a bad field."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.model_spec import ModelSpec, parse_model_spec


def test_parse_turns_lists_into_tuples() -> None:
    spec = parse_model_spec(
        {"name": "dcn", "embedding_dim": 8, "deep_mlp": [16, 8], "cross_layers": 0}
    )
    assert spec == ModelSpec(name="dcn", embedding_dim=8, deep_mlp=(16, 8), cross_layers=0)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({}, "model.name"),
        ({"name": "gpt"}, "model.name"),
        ({"name": "dlrm", "embeding_dim": 16}, "model.embeding_dim"),
        ({"name": "dlrm", "embedding_dim": 0}, "model.embedding_dim"),
        ({"name": "dlrm", "embedding_dim": True}, "model.embedding_dim"),
        ({"name": "dlrm", "embedding_dim": 8.0}, "model.embedding_dim"),
        ({"name": "dlrm", "embedding_dim": 32}, "model.bottom_mlp"),
        ({"name": "dlrm", "bottom_mlp": []}, "model.bottom_mlp"),
        ({"name": "dlrm", "bottom_mlp": 16}, "model.bottom_mlp"),
        ({"name": "dlrm", "top_mlp": [512, -1]}, "model.top_mlp[1]"),
        ({"name": "deepfm", "deep_mlp": ["400"]}, "model.deep_mlp[0]"),
        ({"name": "dcn", "cross_layers": -1}, "model.cross_layers"),
        ({"factory": "my_models.build"}, "model.factory"),
        ({"factory": "my_models:"}, "model.factory"),
        ({"factory": ":build"}, "model.factory"),
        ({"factory": "my-models:build"}, "model.factory"),
        ({"factory": "my_models:build()"}, "model.factory"),
        ({"factory": 3}, "model.factory"),
        ({"factory": "my_models:build", "name": "dlrm"}, "model.factory"),
    ],
)
def test_bad_fields_raise_config_error_naming_them(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_model_spec(section)
    assert info.value.field == field


def test_bottom_mlp_is_only_checked_against_the_dimension_for_dlrm() -> None:
    assert parse_model_spec({"name": "deepfm", "embedding_dim": 32}).embedding_dim == 32


def test_a_factory_stands_for_the_name() -> None:
    spec = parse_model_spec({"factory": "my_pkg.models:Tower.build", "deep_mlp": [32]})
    assert spec == ModelSpec(factory="my_pkg.models:Tower.build", deep_mlp=(32,))
    assert spec.name is None
