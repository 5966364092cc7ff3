from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.optimizer_spec import OptimizerSpec, parse_optimizer_spec
from trainer.optim import (
    SGD,
    EmbeddingOptimizer,
    RowWiseAdagrad,
    build_dense_optimizer,
    build_embedding_optimizer,
    correctly_rounded_sqrt,
    mean_of_squares,
)


def test_sgd_by_hand() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    grad = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    opt = SGD(lr=0.1)
    state = opt.initial_state(2)
    assert opt.state_width == 0 and state.shape == (2, 0)
    opt.step(rows, state, grad)
    torch.testing.assert_close(rows, torch.tensor([[0.95, 2.1], [2.8, -4.0]]))


def test_rowwise_adagrad_by_hand() -> None:
    opt = RowWiseAdagrad(lr=0.5, eps=0.0, initial_accumulator=1.0)
    rows = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    state = opt.initial_state(2)
    assert opt.state_width == 1
    torch.testing.assert_close(state, torch.tensor([[1.0], [1.0]]))
    # Row 0: mean(3², 1²) = 5 -> acc 6. Row 1: mean(4², 4²) = 16 -> acc 17.
    opt.step(rows, state, torch.tensor([[3.0, 1.0], [4.0, -4.0]]))
    torch.testing.assert_close(state, torch.tensor([[6.0], [17.0]]))
    s6, s17 = math.sqrt(6.0), math.sqrt(17.0)
    torch.testing.assert_close(
        rows,
        torch.tensor([[1 - 0.5 * 3 / s6, 1 - 0.5 * 1 / s6], [-0.5 * 4 / s17, 2 + 0.5 * 4 / s17]]),
    )
    # The accumulator keeps growing: a second identical step moves each row less.
    before = rows.clone()
    opt.step(rows, state, torch.tensor([[3.0, 1.0], [4.0, -4.0]]))
    torch.testing.assert_close(state, torch.tensor([[11.0], [33.0]]))
    torch.testing.assert_close(before[0, 0] - rows[0, 0], torch.tensor(0.5 * 3 / math.sqrt(11.0)))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 6),
    d=st.integers(1, 5),
    lr=st.floats(1e-3, 1.0),
    eps=st.floats(1e-10, 1e-2),
    init=st.floats(0.0, 2.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_rowwise_adagrad_matches_the_formula_in_float64(
    n: int, d: int, lr: float, eps: float, init: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rows0 = rng.standard_normal((n, d)).astype(np.float32)
    grad = rng.standard_normal((n, d)).astype(np.float32)
    acc0 = np.full((n, 1), np.float32(init), dtype=np.float64)
    acc = acc0 + (grad.astype(np.float64) ** 2).mean(axis=1, keepdims=True)
    expected = rows0 - lr * grad / (np.sqrt(acc) + eps)

    opt = RowWiseAdagrad(lr=lr, eps=eps, initial_accumulator=init)
    rows, state = torch.from_numpy(rows0.copy()), opt.initial_state(n)
    opt.step(rows, state, torch.from_numpy(grad))
    np.testing.assert_allclose(state.numpy(), acc, rtol=1e-5)
    np.testing.assert_allclose(rows.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt", [SGD(lr=0.1), RowWiseAdagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_step_at_updates_only_the_indexed_rows(opt: SGD | RowWiseAdagrad) -> None:
    table = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    state = opt.initial_state(6)
    index = torch.tensor([4, 1])
    grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    expected_rows, expected_state = table[index].clone(), state[index].clone()
    opt.step(expected_rows, expected_state, grad)
    untouched = torch.tensor([0, 2, 3, 5])
    before = table[untouched].clone()

    opt.step_at(table, state, index, grad)
    torch.testing.assert_close(table[index], expected_rows)
    torch.testing.assert_close(state[index], expected_state)
    torch.testing.assert_close(table[untouched], before)
    assert (state[untouched] == 0).all()


def test_step_rejects_mismatched_shapes_and_dtypes() -> None:
    opt = RowWiseAdagrad(lr=0.1)
    rows, grad = torch.zeros(3, 2), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="state"):
        opt.step(rows, torch.zeros(3, 2), grad)
    with pytest.raises(ValueError, match="grad"):
        opt.step(rows, opt.initial_state(3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="float32"):
        opt.step(rows, opt.initial_state(3), grad.double())


def test_parse_defaults_and_builders() -> None:
    spec = parse_optimizer_spec({})
    assert spec == OptimizerSpec()
    assert build_embedding_optimizer(spec) == SGD(lr=0.01)
    spec = parse_optimizer_spec(
        {
            "embedding": "rowwise_adagrad",
            "embedding_lr": 1,
            "dense": "adagrad",
            "dense_lr": 0.05,
            "eps": 1e-6,
            "initial_accumulator": 0.1,
        }
    )
    expected = RowWiseAdagrad(lr=1, eps=1e-6, initial_accumulator=0.1)
    assert build_embedding_optimizer(spec) == expected
    dense = build_dense_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(dense, torch.optim.Adagrad)
    group = dense.param_groups[0]
    assert (group["lr"], group["eps"], group["initial_accumulator_value"]) == (0.05, 1e-6, 0.1)
    sgd = build_dense_optimizer(OptimizerSpec(dense_lr=0.3), [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.3


@pytest.mark.parametrize("embedding", ["sgd", "rowwise_adagrad"])
def test_the_built_optimizer_keeps_the_row_state_its_spec_announces(embedding: str) -> None:
    """The PS sizes and fills row state from the spec alone; the trainer's optimizer must agree."""
    spec = OptimizerSpec(embedding=embedding, initial_accumulator=0.25)  # type: ignore[arg-type]
    state = build_embedding_optimizer(spec).initial_state(3)
    assert state.shape == (3, spec.state_width)
    assert (state == spec.state_init).all()


@pytest.mark.parametrize("dim", [1, 2, 3, 16, 17, 64])
def test_a_rows_adagrad_state_does_not_depend_on_the_rows_stepped_with_it_or_their_layout(dim: int) -> None:
    """Modes step different sets of rows together (sync_now, sync_later, rows held back): a
    row's new state must be the same bits whichever. `square().mean(dim=1)` fails this on
    the CPU for a transposed layout (and on a GPU its grouping follows the launch shape)."""
    g = torch.Generator().manual_seed(dim)
    grad = torch.randn(300, dim, generator=g) * 10.0 ** torch.randint(-3, 4, (300, dim), generator=g)
    opt = RowWiseAdagrad(lr=0.1)

    def stepped(grads: torch.Tensor) -> torch.Tensor:
        rows, state = torch.ones(grads.shape), torch.full((grads.shape[0], 1), 0.5)
        opt.step(rows, state, grads)
        return torch.cat([rows, state], dim=1)

    together = stepped(grad)
    alone = torch.cat([stepped(grad[i : i + 1]) for i in range(grad.shape[0])])
    assert torch.equal(together, alone)
    assert torch.equal(together[::7], stepped(grad[::7].clone()))
    assert torch.equal(together, stepped(grad.t().contiguous().t()))
    exact = grad.double().square().mean(dim=1)
    assert torch.allclose(mean_of_squares(grad).squeeze(1).double(), exact, rtol=1e-6)


def _table(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g), torch.rand(rows, 1, generator=g) * 3, g


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), d=st.integers(1, 70), lr=st.floats(1e-4, 1.0), eps=st.floats(1e-10, 1e-2),
       seed=st.integers(0, 2**31 - 1))
def test_the_fused_cpu_step_gives_the_bits_of_the_torch_ops(n: int, d: int, lr: float, eps: float, seed: int) -> None:
    """`RowWiseAdagrad.step_at` on CPU tensors runs one fused kernel (trainer/kernels.py); on
    a GPU the torch ops run. Both must end every row and state with the same bits, or a
    cluster would differ from its reference by device. Gradients span seven decades, so the
    squares' sums and the roots round often."""
    table, state, g = _table(max(n, 1) * 2, d, seed)
    index = torch.randperm(table.shape[0], generator=g)[:n]
    grad = torch.randn(n, d, generator=g) * 10.0 ** torch.randint(-3, 4, (n, d), generator=g)
    opt = RowWiseAdagrad(lr=lr, eps=eps)
    fused_table, fused_state = table.clone(), state.clone()
    opt.step_at(fused_table, fused_state, index, grad)
    EmbeddingOptimizer.step_at(opt, table, state, index, grad)  # the torch ops: gather, step, scatter
    assert torch.equal(fused_table, table) and torch.equal(fused_state, state)
    # and from rows of a larger gradient, divided by T as the engine hands them over
    source = torch.randn(n + 5, d, generator=g)
    positions = torch.randperm(n + 5, generator=g)[:n]
    opt.step_at(fused_table, fused_state, index, source, positions=positions, divisor=3)
    EmbeddingOptimizer.step_at(opt, table, state, index, source[positions] / 3)
    assert torch.equal(fused_table, table) and torch.equal(fused_state, state)


def test_a_step_on_tensors_the_kernel_cannot_take_runs_the_torch_ops_to_the_same_bits() -> None:
    table, state, g = _table(50, 8, 3)
    index, grad = torch.tensor([7, 3, 41]), torch.randn(3, 8, generator=g)
    opt = RowWiseAdagrad(lr=0.2)
    want_table, want_state = table.clone(), state.clone()
    opt.step_at(want_table, want_state, index, grad)
    strided = torch.zeros(50, 16)[:, ::2]  # not contiguous: the torch ops, in place all the same
    strided.copy_(table)
    opt.step_at(strided, state, index, grad)
    assert torch.equal(strided, want_table) and torch.equal(state, want_state)


def test_the_fused_step_refuses_a_slot_outside_the_table_and_changes_nothing() -> None:
    table, state, g = _table(10, 4, 5)
    before = table.clone(), state.clone()
    opt = RowWiseAdagrad(lr=0.1)
    with pytest.raises(IndexError, match="outside the table"):
        opt.step_at(table, state, torch.tensor([2, 10]), torch.ones(2, 4))
    with pytest.raises(IndexError, match="outside the table"):
        opt.step_at(table, state, torch.tensor([-1]), torch.ones(1, 4))
    with pytest.raises(ValueError, match="grad"):
        opt.step_at(table, state, torch.tensor([2, 3]), torch.ones(3, 4))
    with pytest.raises(IndexError, match="outside the gradient"):
        opt.step_at(table, state, torch.tensor([2, 3]), torch.ones(3, 4), positions=torch.tensor([0, 3]))
    assert torch.equal(table, before[0]) and torch.equal(state, before[1])


def test_the_root_is_correctly_rounded() -> None:
    """IEEE's float32 root (numpy's) for a million values over every binade a state holds."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1_000_000, generator=g) * 10.0 ** torch.randint(-30, 30, (1_000_000,), generator=g)
    assert np.array_equal(correctly_rounded_sqrt(x).numpy(), np.sqrt(x.numpy()))
