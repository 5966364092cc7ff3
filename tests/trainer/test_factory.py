"""`[model] factory`: a model defined here, in the test module, trains in every mode bit for
bit like the data-parallel reference (in process, two trainers); every way a factory can be
wrong fails at start-up with a ConfigError naming `model.factory`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from common.job import build_job
from common.model_spec import ModelSpec
from common.spec import load_spec
from launcher.inprocess import run_in_process
from tests.cluster_helpers import as_final, assert_identical, reference_for, write_spec
from tests.trainer.test_equivalence import CACHE_ROWS, MODES, assert_cache_was_exercised
from trainer.models import build_model

HERE = __name__  # "tests.trainer.test_factory": the factories below are named from it


class GatedBilinear(nn.Module):
    """Unlike any built-in model: the dense features gate each table's embedding, a bilinear
    form mixes the gated mean with the first feature, LayerNorm and GELU on the way."""

    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__()
        d = spec.embedding_dim
        self.gate = nn.Linear(num_dense, num_tables)
        self.bilinear = nn.Bilinear(d, d, 4)
        self.norm = nn.LayerNorm(num_tables * d)
        self.out = nn.Linear(num_tables * d + 4, 1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        gated = emb * torch.sigmoid(self.gate(dense)).unsqueeze(-1)  # (B, F, d)
        pair = F.gelu(self.bilinear(gated.mean(dim=1), emb[:, 0]))  # (B, 4)
        z = torch.cat([self.norm(gated.flatten(1)), pair], dim=1)  # (B, F d + 4)
        return self.out(z).squeeze(-1)  # (B,)


def gated_bilinear(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return GatedBilinear(spec, num_dense, num_tables)


def test_a_model_of_the_test_module_is_bit_identical_in_every_mode(tmp_path: Path) -> None:
    model = {"factory": f"{HERE}:gated_bilinear", "embedding_dim": 8}
    jobs = {
        mode: build_job(load_spec(write_spec(
            tmp_path, mode, {"oracle": {"mode": mode, "cache_rows": CACHE_ROWS[2]}, "trainers": {"count": 2}},
            model=model,
        )))
        for mode in MODES
    }
    runs = {mode: run_in_process(job) for mode, job in jobs.items()}
    assert "bilinear.weight" in runs["bagpipe"].model.dense  # this module's model trained
    for mode in MODES[1:]:
        assert_identical(runs[mode].model, runs["bagpipe"].model)
    assert_identical(runs["bagpipe"].model, as_final(reference_for(jobs["bagpipe"])))
    assert_cache_was_exercised(jobs["bagpipe"], runs["bagpipe"])


def test_the_readme_example_builds_and_trains_a_step() -> None:
    spec = ModelSpec(factory="examples.my_model:build", embedding_dim=8, deep_mlp=(16,))
    model = build_model(spec, 4, 3)
    logits = model(torch.randn(5, 4), torch.randn(5, 3, 8))
    assert logits.shape == (5,)
    logits.sum().backward()


# -- factories that are wrong, one way each ----------------------------------------------

NOT_CALLABLE = 3


def returns_a_function(spec: ModelSpec, num_dense: int, num_tables: int) -> Any:
    return gated_bilinear


def raises(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    raise ValueError("hidden size must be even")


class _Logits(nn.Module):
    """Returns what `make` gives for the batch, through one used parameter."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.make = make

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> Any:
        return self.make(emb.sum(dim=(1, 2)) * self.weight)


def column_logits(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return _Logits(lambda logits: logits.unsqueeze(-1))  # (B, 1): the usual slip


def double_logits(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return _Logits(lambda logits: logits.double())


def tuple_logits(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return _Logits(lambda logits: (logits, None))


def failing_forward(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return nn.Linear(spec.embedding_dim, 1)  # forward takes one argument, not two


class _Unused(GatedBilinear):
    def __init__(self, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
        super().__init__(spec, num_dense, num_tables)
        self.spare = nn.Linear(2, 2)


def unused_parameter(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return _Unused(spec, num_dense, num_tables)


def no_parameters(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    return nn.Flatten()


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        ("no_such_package.models:build", "cannot import 'no_such_package.models'"),
        (f"{HERE}:nowhere", "has no attribute 'nowhere'"),
        (f"{HERE}:GatedBilinear.nowhere", "has no attribute 'GatedBilinear.nowhere'"),
        (f"{HERE}:NOT_CALLABLE", "is a int, not callable"),
        (f"{HERE}:returns_a_function", "returned a function, not a torch.nn.Module"),
        (f"{HERE}:raises", "raised ValueError('hidden size must be even')"),
        (f"{HERE}:column_logits", "shape (2, 1); it must return float32 logits of shape (2,)"),
        (f"{HERE}:double_logits", "returned torch.float64 of shape (2,)"),
        (f"{HERE}:tuple_logits", "returned a tuple, not a tensor"),
        (f"{HERE}:failing_forward", "forward(dense (2, 4), emb (2, 3, 8)) raised TypeError"),
        (f"{HERE}:unused_parameter", "parameters ['spare.weight', 'spare.bias'] get no gradient"),
        (f"{HERE}:no_parameters", "no trainable parameter"),
    ],
)
def test_a_bad_factory_fails_naming_the_field(factory: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_model(ModelSpec(factory=factory, embedding_dim=8), 4, 3)
    assert info.value.field == "model.factory"
    assert says in info.value.message


def test_a_module_failing_at_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_model.py").write_text("import torch\nraise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"model.factory: cannot import 'broken_model'.*needs a GPU"):
        build_model(ModelSpec(factory="broken_model:build", embedding_dim=8), 4, 3)


def test_the_probe_leaves_no_trace() -> None:
    """Generator, mode and gradients as before: trainers and reference build the same model."""
    spec = ModelSpec(factory=f"{HERE}:gated_bilinear", embedding_dim=8)
    torch.manual_seed(5)
    probed = build_model(spec, 4, 3)
    after_probed = torch.rand(4)
    torch.manual_seed(5)
    plain = GatedBilinear(spec, 4, 3)
    assert torch.equal(torch.rand(4), after_probed)
    assert probed.training
    assert all(p.grad is None for p in probed.parameters())
    assert all(torch.equal(p, q) for p, q in zip(probed.parameters(), plain.parameters()))
