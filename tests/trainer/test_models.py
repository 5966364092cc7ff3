from __future__ import annotations

import itertools

import pytest
import torch

from common.errors import ConfigError
from common.model_spec import MODEL_NAMES, ModelSpec, parse_model_spec
from trainer.models import build_model
from trainer.models.deepfm import fm_second_order
from trainer.models.dlrm import pairwise_dots

D = 4


def small_spec(name: str, **overrides: object) -> ModelSpec:
    sizes: dict[str, object] = dict(
        embedding_dim=D, bottom_mlp=(8, D), top_mlp=(8,), deep_mlp=(8, 4), cross_layers=2
    )
    sizes.update(overrides)
    return ModelSpec(name=name, **sizes)  # type: ignore[arg-type]


def inputs(batch: int, num_dense: int, num_tables: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, num_dense, generator=g)
    return dense, torch.randn(batch, num_tables, D, generator=g)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("num_dense", [0, 3])
def test_forward_gives_one_logit_per_example_and_grads_reach_every_feature(
    name: str, num_dense: int
) -> None:
    model = build_model(small_spec(name), num_dense, num_tables=3)
    dense, emb = inputs(5, num_dense, 3)
    emb.requires_grad_(True)
    logits = model(dense, emb)
    assert logits.shape == (5,)
    assert logits.dtype == torch.float32
    logits.sum().backward()
    assert emb.grad is not None
    assert (emb.grad.abs().sum(dim=(0, 2)) > 0).all()  # every categorical feature gets a gradient
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_examples_do_not_mix_within_a_batch(name: str) -> None:
    model = build_model(small_spec(name), 3, num_tables=3)
    dense, emb = inputs(4, 3, 3)
    together = model(dense, emb)
    one_by_one = torch.cat([model(dense[i : i + 1], emb[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(together, one_by_one)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_builds_the_same_model(name: str) -> None:
    torch.manual_seed(7)
    a = build_model(small_spec(name), 3, 2).state_dict()
    torch.manual_seed(7)
    b = build_model(small_spec(name), 3, 2).state_dict()
    torch.manual_seed(8)
    c = build_model(small_spec(name), 3, 2).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_models_hold_no_embedding_tables() -> None:
    # The tables live in the PS/cache; the model's parameters are the dense, DDP-replicated ones.
    for name in MODEL_NAMES:
        model = build_model(small_spec(name), 3, 2)
        tables = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        assert not any(isinstance(m, tables) for m in model.modules())


def test_pairwise_dots_match_a_loop_over_pairs() -> None:
    v = torch.randn(2, 4, 3)
    expected = torch.stack(
        [(v[:, i] * v[:, j]).sum(-1) for i, j in itertools.combinations(range(4), 2)], dim=1
    )
    torch.testing.assert_close(pairwise_dots(v), expected)


def test_fm_second_order_matches_a_loop_over_pairs() -> None:
    e = torch.randn(3, 5, 4)
    expected = sum((e[:, i] * e[:, j]).sum(-1) for i, j in itertools.combinations(range(5), 2))
    torch.testing.assert_close(fm_second_order(e), expected)


def test_dlrm_top_mlp_width_follows_the_interaction() -> None:
    with_dense = build_model(small_spec("dlrm"), 3, 4)
    # d + pairs among (bottom output + 4 embeddings) = 4 + 10
    assert with_dense.top.net[0].in_features == D + 10
    no_dense = build_model(small_spec("dlrm"), 0, 4)
    assert no_dense.bottom is None
    assert no_dense.top.net[0].in_features == 6


def test_criteo_defaults() -> None:
    spec = parse_model_spec({"name": "dlrm"})
    assert spec.embedding_dim == 16
    assert spec.bottom_mlp == (512, 256, 64, 16)
    assert spec.top_mlp == (512, 256)
    model = build_model(spec, 13, 26)
    assert model(torch.zeros(2, 13), torch.zeros(2, 26, 16)).shape == (2,)


def test_build_model_rejects_impossible_feature_counts() -> None:
    with pytest.raises(ConfigError) as info:
        build_model(small_spec("dlrm"), 0, 1)
    assert info.value.field == "data.num_tables"
    with pytest.raises(ConfigError) as info:
        build_model(small_spec("dcn"), -1, 2)
    assert info.value.field == "data.num_dense"
