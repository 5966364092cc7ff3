"""Rows staged on arrival: the CPU path of the CUDA staging, and the pinned-buffer pool."""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from trainer.device import CUBLAS_WORKSPACE, StagingPool, deterministic_kernels, select_device


@dataclass
class Fetched:
    rows: np.ndarray
    state: np.ndarray


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_staging_starts_when_the_fetch_completes_and_keeps_the_values() -> None:
    device = select_device("cpu", 0)
    fetch: concurrent.futures.Future = concurrent.futures.Future()
    staged = device.stage_when_done(fetch)
    assert not staged.done()
    rows, state = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((3, 1), np.float32)
    fetch.set_result(Fetched(rows, state))
    assert staged.done()
    got = staged.result()
    assert torch.equal(got.rows, torch.from_numpy(rows)) and torch.equal(got.state, torch.from_numpy(state))
    assert got.copied.query()


def test_a_failed_fetch_fails_its_staging() -> None:
    fetch: concurrent.futures.Future = concurrent.futures.Future()
    staged = select_device("cpu", 0).stage_when_done(fetch)
    fetch.set_exception(TimeoutError("shard 1 did not answer"))
    with pytest.raises(TimeoutError, match="shard 1"):
        staged.result()


def test_a_buffer_is_reused_only_once_its_copy_is_done() -> None:
    made: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = StagingPool(allocate)
    first = pool.take(1000)
    assert made == [1024]  # rounded up to a power of two, to fit later requests
    copying = FakeEvent(done=False)
    pool.give_back(first, copying)
    second = pool.take(900)
    assert second is not first and made == [1024, 1024]
    pool.give_back(second, FakeEvent(done=True))
    copying.done = True
    assert pool.take(1024) is first
    assert pool.take(2000) is not second and made[-1] == 2048
    assert len(pool) == 1


def test_the_pool_hands_out_the_smallest_buffer_that_fits_and_keeps_a_bounded_amount() -> None:
    pool = StagingPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8), keep_bytes=3000)
    done = FakeEvent(done=True)
    for size in (2048, 512, 1024):
        pool.give_back(torch.empty(size, dtype=torch.uint8), done)
    assert len(pool) == 2  # 3,584 bytes would exceed 3,000: the largest (2,048) went
    assert pool.take(600).numel() == 1024  # best fit, not the first that fits
    assert pool.take(100).numel() == 512


def test_cuda_runs_with_deterministic_kernels_and_a_cublas_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `select_device` sets up for CUDA (callable on the CPU): without it the backward
    of index_select adds a hot row's gradients with atomics, in any order."""
    name, value = CUBLAS_WORKSPACE
    monkeypatch.delenv(name, raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ[name] == value
    finally:
        torch.use_deterministic_algorithms(before)


def test_uploads_on_the_cpu_are_the_arrays_themselves() -> None:
    device = select_device("cpu", 0)
    a = np.arange(5, dtype=np.int64)
    t = device.upload(a)
    assert t.dtype == torch.int64 and t.tolist() == a.tolist()
    device.synchronize()  # a no-op without CUDA
