from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.init import initial_rows
from common.keys import TableLayout
from common.model_spec import MODEL_NAMES, ModelSpec
from common.optimizer_spec import OptimizerSpec
from tests.trainer.reference import Batch, ReferenceTrainer, reference_train
from trainer.models import build_model

D = 4
SEED = 3
LAYOUT = TableLayout(sizes=(6, 5, 7))
SGD_SPEC = OptimizerSpec(embedding="sgd", embedding_lr=0.9, dense="sgd", dense_lr=0.6)
ADAGRAD_SPEC = OptimizerSpec(
    embedding="rowwise_adagrad",
    embedding_lr=0.6,
    dense="adagrad",
    dense_lr=0.3,
    eps=1e-8,
    initial_accumulator=0.1,
)


def small_spec(name: str) -> ModelSpec:
    return ModelSpec(
        name=name,  # type: ignore[arg-type]
        embedding_dim=D,
        bottom_mlp=(8, D),
        top_mlp=(8,),
        deep_mlp=(8,),
        cross_layers=1,
    )


def random_batches(count: int, batch: int, num_dense: int, seed: int) -> list[Batch]:
    """Batches whose label is learnable: 1 exactly when table 0's row is in its lower half."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        rows = torch.stack([torch.randint(0, n, (batch,), generator=g) for n in LAYOUT.sizes], 1)
        keys = torch.from_numpy(LAYOUT.to_keys(rows.numpy()))  # (B, F) global keys
        labels = (rows[:, 0] < LAYOUT.sizes[0] // 2).float()
        out.append((labels, torch.randn(batch, num_dense, generator=g), keys))
    return out


def hand_step(
    spec: ModelSpec, opt: OptimizerSpec, num_dense: int, batch: Batch
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, float]:
    """One step computed independently: gradients w.r.t. the whole table, formulas written out."""
    labels, dense, keys = batch
    torch.manual_seed(SEED)
    model = build_model(spec, num_dense, LAYOUT.num_tables)
    table = torch.from_numpy(initial_rows(LAYOUT, SEED, np.arange(LAYOUT.total_rows), D))
    full = table.clone().requires_grad_(True)
    loss = F.binary_cross_entropy_with_logits(model(dense, F.embedding(keys, full)), labels)
    names, params = zip(*model.named_parameters())
    table_grad, *dense_grads = torch.autograd.grad(loss, [full, *params])

    used = torch.unique(keys)
    g = table_grad[used]
    state = torch.full((LAYOUT.total_rows, 1), opt.initial_accumulator)
    new_params = {}
    if opt.embedding == "sgd":
        table[used] = table[used] - opt.embedding_lr * g
        state = state[:, :0]
    else:
        state[used] += (g * g).mean(dim=1, keepdim=True)
        table[used] = table[used] - opt.embedding_lr * g / (state[used].sqrt() + opt.eps)
    for name, p, pg in zip(names, params, dense_grads):
        if opt.dense == "sgd":
            new_params[name] = p.detach() - opt.dense_lr * pg
        else:
            acc = opt.initial_accumulator + pg * pg
            new_params[name] = p.detach() - opt.dense_lr * pg / (acc.sqrt() + opt.eps)
    return new_params, table, state, float(loss.detach())


@pytest.mark.parametrize("opt", [SGD_SPEC, ADAGRAD_SPEC], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_one_step_equals_the_hand_computed_step(name: str, opt: OptimizerSpec) -> None:
    spec = small_spec(name)
    batch = random_batches(1, 8, 2, seed=11)[0]
    params, table, state, loss = hand_step(spec, opt, 2, batch)

    result = reference_train(spec, opt, LAYOUT, SEED, [batch], num_dense=2)
    assert result.losses == pytest.approx((loss,), rel=1e-6)
    assert result.dense_state.keys() == params.keys()
    for key, value in params.items():
        torch.testing.assert_close(result.dense_state[key], value, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.table, table, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.state, state, rtol=1e-5, atol=1e-7)
    # The case is not vacuous: every used row moved, and some rows were left untouched.
    used = torch.unique(batch[2])
    initial = torch.from_numpy(initial_rows(LAYOUT, SEED, used.numpy(), D))
    assert (result.table[used] != initial).any(dim=1).all()
    assert len(used) < LAYOUT.total_rows


def test_untouched_rows_keep_their_initial_value_and_state() -> None:
    # Table 0 only ever sees rows 0 and 1; its other rows must stay exactly as initialised.
    labels, dense, keys = random_batches(1, 8, 2, seed=5)[0]
    keys[:, 0] = torch.tensor([0, 1] * 4)
    batches = [(labels, dense, keys)]
    result = reference_train(small_spec("dlrm"), ADAGRAD_SPEC, LAYOUT, SEED, batches, 2)
    rest = np.arange(2, LAYOUT.sizes[0])
    torch.testing.assert_close(
        result.table[rest], torch.from_numpy(initial_rows(LAYOUT, SEED, rest, D)), rtol=0, atol=0
    )
    assert (result.state[rest] == ADAGRAD_SPEC.initial_accumulator).all()
    assert (result.state[:2] > ADAGRAD_SPEC.initial_accumulator).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_of_a_repeated_key_are_summed(name: str) -> None:
    # Key 0 is used by all three examples; row-wise Adagrad sees the summed gradient once:
    # acc = init + mean((g_0 + g_1 + g_2)²), not three separate accumulations.
    spec = small_spec(name)
    labels = torch.tensor([1.0, 0.0, 1.0])
    dense = torch.randn(3, 2, generator=torch.Generator().manual_seed(2))
    keys = torch.from_numpy(LAYOUT.to_keys(np.array([[0, 1, 2], [0, 3, 4], [0, 2, 6]])))

    torch.manual_seed(SEED)
    model = build_model(spec, 2, LAYOUT.num_tables)
    table = torch.from_numpy(initial_rows(LAYOUT, SEED, np.arange(LAYOUT.total_rows), D))
    per_use = table[keys].requires_grad_(True)  # (B, F, d): one leaf per use
    F.binary_cross_entropy_with_logits(model(dense, per_use), labels).backward()
    assert per_use.grad is not None
    summed = per_use.grad[:, 0].sum(dim=0)  # (d,) the three uses of key 0
    assert not torch.allclose(summed, per_use.grad[0, 0])

    result = reference_train(spec, ADAGRAD_SPEC, LAYOUT, SEED, [(labels, dense, keys)], 2)
    acc = ADAGRAD_SPEC.initial_accumulator + (summed * summed).mean()
    torch.testing.assert_close(result.state[0, 0], acc, rtol=1e-5, atol=0)
    expected = table[0] - ADAGRAD_SPEC.embedding_lr * summed / (acc.sqrt() + ADAGRAD_SPEC.eps)
    torch.testing.assert_close(result.table[0], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opt", [SGD_SPEC, ADAGRAD_SPEC], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loss_decreases_on_a_learnable_problem(name: str, opt: OptimizerSpec) -> None:
    batches = random_batches(60, 32, 2, seed=1)
    losses = reference_train(small_spec(name), opt, LAYOUT, SEED, batches, 2).losses
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loss_decreases_without_dense_features(name: str) -> None:
    batches = random_batches(60, 32, 0, seed=1)
    losses = reference_train(small_spec(name), ADAGRAD_SPEC, LAYOUT, SEED, batches, 0).losses
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


def test_same_inputs_give_bit_identical_results() -> None:
    batches = random_batches(3, 8, 2, seed=9)
    a = reference_train(small_spec("dcn"), ADAGRAD_SPEC, LAYOUT, SEED, batches, 2)
    b = reference_train(small_spec("dcn"), ADAGRAD_SPEC, LAYOUT, SEED, batches, 2)
    assert a.losses == b.losses
    assert torch.equal(a.table, b.table) and torch.equal(a.state, b.state)
    assert all(torch.equal(a.dense_state[k], b.dense_state[k]) for k in a.dense_state)


def test_trainer_starts_from_the_seeded_model_and_initial_rows() -> None:
    trainer = ReferenceTrainer(small_spec("deepfm"), SGD_SPEC, LAYOUT, SEED, 2)
    torch.manual_seed(SEED)
    model = build_model(small_spec("deepfm"), 2, LAYOUT.num_tables)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), model.parameters()))
    expected = initial_rows(LAYOUT, SEED, np.arange(LAYOUT.total_rows), D)
    assert np.array_equal(trainer.table.numpy(), expected)
    assert trainer.state.shape == (LAYOUT.total_rows, 0)


def test_rejects_keys_outside_the_tables() -> None:
    labels, dense, keys = random_batches(1, 4, 2, seed=0)[0]
    keys[0, 2] = LAYOUT.total_rows
    trainer = ReferenceTrainer(small_spec("wide_deep"), SGD_SPEC, LAYOUT, SEED, 2)
    with pytest.raises(Exception, match="outside"):
        trainer.step(labels, dense, keys)
