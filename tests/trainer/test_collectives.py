"""The exact sums of `trainer.collectives` over real gloo groups (in one process, a thread per
rank): every element added in rank order, at any T, for the embedding gradients and, through
DDP's communication hook, for the dense ones."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launcher.inprocess import _run_ranks, process_groups
from trainer.collectives import (
    GLOO_LOOP_THREAD,
    TRAINING_THREAD_TAG,
    Collectives,
    OrderedSum,
    PairSum,
    calm_gloo_loops,
    ordered_sum,
    ordered_sum_by_all_to_all,
    peers_unreachable,
)


def _ranks(world: int, name: str, work: Callable[[Collectives], object]) -> list[object]:
    """`work(comm)` on one thread per rank; the results in rank order."""
    groups, background = process_groups(world, name), process_groups(world, f"{name}-background")
    out: list[object] = [None] * world

    def run(rank: int) -> None:
        comm = Collectives(world_size=world, rank=rank, group=groups[rank], background=background[rank])
        try:
            out[rank] = work(comm)
        finally:
            comm.close()

    _run_ranks(world, run)
    return out


def gloo_groups(world: int, name: str, timeout_s: float) -> list[dist.ProcessGroupGloo]:
    """A world's gloo groups, one per rank, made afresh (not cached, as `process_groups`'
    are) with a short timeout: for tests of a peer that never answers."""
    store, groups = dist.HashStore(), [None] * world

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, timedelta(seconds=timeout_s))

    _run_ranks(world, join)
    return groups  # type: ignore[return-value]


def _in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def _operands(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    # Magnitudes far apart, so that the order of the additions shows in the last bits.
    g = torch.Generator().manual_seed(rank)
    return torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 5, shape, generator=g)


@pytest.mark.parametrize("world", [3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(1,), (2, 3), (7, 16), (1000, 16)])
def test_ordered_sum_adds_every_element_in_rank_order(world: int, shape: tuple[int, ...]) -> None:
    def work(comm: Collectives) -> torch.Tensor:
        return ordered_sum(comm.group, _operands(comm.rank, shape), comm.rank, comm.world_size)

    want = _in_rank_order([_operands(r, shape) for r in range(world)])
    for got in _ranks(world, f"ordered-{world}", work):
        assert isinstance(got, torch.Tensor) and got.shape == shape
        assert torch.equal(got, want)


def test_an_ordered_sum_waited_twice_is_finished_once() -> None:
    def work(comm: Collectives) -> torch.Tensor:
        started = OrderedSum(comm.group, _operands(comm.rank, (30, 4)), comm.rank, comm.world_size, TRAINING_THREAD_TAG)
        got = started.wait()
        again = started.wait()  # a second wait on gloo's requests would wait out the timeout
        assert again.data_ptr() == got.data_ptr() and torch.equal(again, got)
        return got

    want = _in_rank_order([_operands(r, (30, 4)) for r in range(3)])
    assert all(torch.equal(got, want) for got in _ranks(3, "twice-3", work))


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("shape", [(2, 3), (1000, 16)])
def test_the_device_path_by_all_to_all_has_the_same_bits(world: int, shape: tuple[int, ...]) -> None:
    """What a tensor on a device takes (gloo runs its all-to-all on host memory too)."""
    def work(comm: Collectives) -> tuple[torch.Tensor, torch.Tensor]:
        t = _operands(comm.rank, shape)
        return ordered_sum_by_all_to_all(comm.group, t, comm.rank, comm.world_size), t

    want = _in_rank_order([_operands(r, shape) for r in range(world)])
    for rank, got in enumerate(_ranks(world, f"all-to-all-{world}", work)):
        assert isinstance(got, tuple) and torch.equal(got[0], want)
        assert torch.equal(got[1], _operands(rank, shape))  # the input is kept


@pytest.mark.parametrize("world", [3, 4])
def test_sums_in_flight_on_both_threads_pair_up_in_the_order_started(world: int) -> None:
    """Above two trainers a training-thread sum travels from `sum_rows` to `wait()` (a join
    while step 3 runs): several at once, of sizes down to fewer elements than ranks, beside
    background sums on the same group (the in-process harness's default), each ends as the
    rank-ordered sum, and its input unchanged."""
    shapes = [(1,), (7, 16), (3000, 17), (2,)]

    def work(comm: Collectives) -> list[torch.Tensor]:
        comm = Collectives(world_size=comm.world_size, rank=comm.rank, group=comm.group)  # background = group
        inputs = [_operands(comm.rank + 10 * i, s) for i, s in enumerate(shapes)]
        later = [comm.sum_rows(_operands(comm.rank + 20 * i, s), background=True) for i, s in enumerate(shapes)]
        now = [comm.sum_rows(t) for t in inputs]
        try:
            got = [s.wait() for s in now + later]
        finally:
            comm.close()
        assert all(torch.equal(t, _operands(comm.rank + 10 * i, s)) for i, (t, s) in enumerate(zip(inputs, shapes, strict=True)))
        return got

    want = ([_in_rank_order([_operands(r + 10 * i, s) for r in range(world)]) for i, s in enumerate(shapes)]
            + [_in_rank_order([_operands(r + 20 * i, s) for r in range(world)]) for i, s in enumerate(shapes)])
    for got in _ranks(world, f"in-flight-{world}", work):
        assert isinstance(got, list)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_ring_all_reduce_adds_in_another_order() -> None:
    """Why `ordered_sum` exists: gloo's ring all-reduce starts each chunk's sum at another
    rank, so some elements differ in their last bits from the rank-ordered sum."""
    world, shape = 4, (4096, 16)

    def work(comm: Collectives) -> torch.Tensor:
        t = _operands(comm.rank, shape)
        comm.group.allreduce([t]).wait()
        return t

    want = _in_rank_order([_operands(r, shape) for r in range(world)])
    got = _ranks(world, "ring-4", work)[0]
    assert isinstance(got, torch.Tensor)
    assert not torch.equal(got, want)


def test_background_sums_run_in_the_order_they_were_started() -> None:
    world = 3

    def work(comm: Collectives) -> list[torch.Tensor]:
        started = [comm.sum_rows(_operands(comm.rank + 10 * i, (50, 4)), background=True) for i in range(5)]
        return [s.wait() for s in started]

    for per_rank in _ranks(world, "background-3", work):
        assert isinstance(per_rank, list)
        for i, got in enumerate(per_rank):
            assert torch.equal(got, _in_rank_order([_operands(r + 10 * i, (50, 4)) for r in range(world)]))


def test_two_trainers_exchange_their_buffers_and_hold_the_all_reduces_bits() -> None:
    """At T = 2 every sum is one exchange (`PairSum`): joins and sync_now on the training
    thread, sync_later on the background thread, several in flight at once on each, paired
    in the order each thread started them. Each ends as a + b, the bits of gloo's all-reduce."""
    shapes = [(1,), (7, 16), (3000, 17)]

    def work(comm: Collectives) -> list[torch.Tensor]:
        later = [comm.sum_rows(_operands(comm.rank + 10 * i, s), background=True) for i, s in enumerate(shapes)]
        now = [comm.sum_rows(_operands(comm.rank + 20 * i, s)) for i, s in enumerate(shapes)]
        joins = [comm.sum_rows(_operands(comm.rank + 30 * i, s)) for i, s in enumerate(shapes)]
        reduced = [_operands(comm.rank + 20 * i, s) for i, s in enumerate(shapes)]
        for t in reduced:
            comm.group.allreduce([t]).wait()
        return [s.wait() for s in joins + now[::-1] + later] + reduced

    def pair(offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return _operands(offset, shape) + _operands(1 + offset, shape)

    want = ([pair(30 * i, s) for i, s in enumerate(shapes)] + [pair(20 * i, s) for i, s in enumerate(shapes)][::-1]
            + [pair(10 * i, s) for i, s in enumerate(shapes)])
    for got in _ranks(2, "pairs-2", work):
        assert isinstance(got, list)
        sums, reduced = got[: len(want)], got[len(want):]
        assert all(torch.equal(a, b) for a, b in zip(sums, want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(reduced, want[len(shapes): 2 * len(shapes)][::-1], strict=True))


def test_a_sum_waited_twice_is_added_once_and_a_strided_buffer_is_refused() -> None:
    def work(comm: Collectives) -> torch.Tensor:
        started = comm.sum_rows(torch.full((4, 2), float(comm.rank + 1)))
        assert started.wait() is started.wait()
        with pytest.raises(ValueError, match="contiguous"):
            PairSum(comm.group, torch.zeros(4, 2).t(), comm.rank, TRAINING_THREAD_TAG)
        return started.wait()

    for got in _ranks(2, "twice-2", work):
        assert torch.equal(got, torch.full((4, 2), 3.0))


@pytest.mark.parametrize("world", [2, 3])  # the hook runs above two trainers; at two it would be exact too
def test_the_ddp_hook_averages_dense_gradients_as_the_reference_does(world: int) -> None:
    """Each trainer's gradient times 1/T, summed in rank order: the data-parallel reference's
    dense step (tests/trainer/reference.py), bit for bit."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)]

    def grads_of(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        model(x).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    def work(comm: Collectives) -> list[torch.Tensor]:
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model.load_state_dict(base.state_dict())
        ddp = DistributedDataParallel(model, process_group=comm.group)
        ddp.register_comm_hook(None, comm.mean_gradients_hook())
        return grads_of(ddp, inputs[comm.rank])

    local = [grads_of(base, x) for x in inputs]
    want = [_in_rank_order([g[i] * (1.0 / world) for g in local]) for i in range(len(local[0]))]
    for got in _ranks(world, f"ddp-{world}", work):
        assert isinstance(got, list)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_in_process_groups_serve_cuda_tensors_too() -> None:
    """DDP's constructor broadcasts parameters on their own device, even at T = 1: the
    harness's groups must have a backend for CUDA as well as for the CPU."""
    group = process_groups(1, "devices")[0]
    assert group._get_backend(torch.device("cuda")) is group._get_backend(torch.device("cpu"))


def test_a_collective_whose_peers_do_not_answer_names_them_and_the_timeout() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                        "20000ms for recv operation to complete")
    error = peers_unreachable(gloo, 1, 3, 20.0)
    assert error is not None
    assert error.message.startswith("trainer 1: a collective with trainers 0, 2 failed (they did not answer within 20 s")
    assert "Timed out waiting 20000ms" in error.message and error.fields["peers"] == [0, 2]
    reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.4]:123")
    assert peers_unreachable(reset, 0, 2, 8.0).message.startswith("trainer 0: a collective with trainer 1 failed")


def test_an_ordered_sum_whose_peer_never_comes_fails_naming_it_within_the_timeout() -> None:
    """Above two trainers a sum waits on every peer: one that never starts it (a trainer
    dead or cut off) fails the others after the group's timeout, with the error that names
    the peers and the setting, not a hang."""
    world, timeout_s = 3, 2.0
    groups = gloo_groups(world, "absent-peer", timeout_s)
    errors: dict[int, object] = {}

    def work(rank: int) -> None:
        if rank == 2:
            return  # never starts the sum
        with pytest.raises(RuntimeError) as raised:
            OrderedSum(groups[rank], torch.ones(300, 4), rank, world, TRAINING_THREAD_TAG).wait()
        errors[rank] = peers_unreachable(raised.value, rank, world, timeout_s)

    start = time.monotonic()
    _run_ranks(world, work)
    assert time.monotonic() - start < 10 * timeout_s
    for rank in (0, 1):
        error = errors[rank]
        assert error is not None, f"rank {rank}'s failure is not recognised as a peer's"
        assert error.message.startswith(f"trainer {rank}: a collective with trainers ")  # type: ignore[attr-defined]
        assert error.fields["peers"] == [r for r in range(world) if r != rank]  # type: ignore[attr-defined]


@pytest.mark.parametrize("exc", [ValueError("Timed out"), RuntimeError("CUDA out of memory"),
                                 RuntimeError("expected scalar type Float")])
def test_other_failures_are_left_as_they_are(exc: BaseException) -> None:
    assert peers_unreachable(exc, 0, 2, 8.0) is None
    assert peers_unreachable(RuntimeError("Timed out"), 0, 1, 8.0) is None  # one trainer has no peers


def test_gloo_loop_threads_do_not_preempt_the_threads_that_send() -> None:
    """A group's gloo loop thread runs under SCHED_BATCH once the in-process harness has made
    it, so that it never preempts a sender holding its connection's lock and spins in
    epoll_wait until the tick (`calm_gloo_loops`)."""
    process_groups(2, "calm")
    tasks = Path("/proc/self/task")
    loops = [int(t.name) for t in tasks.iterdir() if (t / "comm").read_text().strip() == GLOO_LOOP_THREAD]
    assert loops, "gloo no longer names its loop threads gloo_tcp_loop: calm_gloo_loops finds none"
    assert all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in loops)
    assert sorted(calm_gloo_loops()) == sorted(loops)


def test_a_sandbox_that_forbids_the_policy_leaves_the_loops_as_they_are(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where seccomp forbids sched_setscheduler, a trainer starts anyway and says so."""
    process_groups(2, "calm")

    def forbidden(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", forbidden)
    assert calm_gloo_loops() == []
    assert "SCHED_BATCH is forbidden here" in caplog.text
