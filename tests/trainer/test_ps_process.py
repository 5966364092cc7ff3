"""The PS client in a helper process (`trainer.ps_process`), against real shards on loopback:
the same rows as a client in this process, write-backs that land, errors raised where the
trainer waits, shared memory reused, and a helper that dies failing every request clearly."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import BadRequest, TimedOut, Unavailable
from common.spec import Endpoint
from ps.client import PsClient
from ps.service import PsService
from tests.ps.conftest import DIM, LAYOUT, TOKEN, make_server, make_service
from tests.trainer.test_collectives import gloo_groups
from launcher.inprocess import _run_ranks
from trainer.collectives import TRAINING_THREAD_TAG, OrderedSum
from trainer.io_thread import IoThread
from trainer.ps_process import PsProcess, SegmentPool

STATE_WIDTH = 1


@dataclass
class Shards:
    helper: PsProcess
    io: IoThread
    endpoints: list[Endpoint]
    services: list[PsService]

    def direct_client(self) -> PsClient:
        return PsClient(self.endpoints, token=TOKEN, dim=DIM, state_width=STATE_WIDTH, timeout_s=10, retries=1)


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[Shards]:
    # The helper is forked first, as a trainer forks it: before any thread or listening socket.
    helper = PsProcess.start(dim=DIM, state_width=STATE_WIDTH, wait_s=0.5)
    io = IoThread()
    services = [make_service(s, 2, tmp_path, fetch_timeout_s=1.0) for s in range(2)]
    servers = [make_server("h2", svc) for svc in services]
    for server in servers:
        io.run(server.start())
    endpoints = [Endpoint(host="127.0.0.1", port=s.port) for s in servers]
    helper.rows.open(dict(endpoints=endpoints, token=TOKEN, dim=DIM, state_width=STATE_WIDTH, timeout_s=10,
                          retries=1, journal_bytes=1 << 20, trainer=0, trainers=1), timeout=10)
    try:
        yield Shards(helper, io, endpoints, services)
    finally:
        helper.close(timeout_s=5)
        for server in servers:
            io.run(server.stop())
        io.close()


def test_fetches_and_write_backs_match_a_client_in_this_process(shards: Shards) -> None:
    rows = shards.helper.rows
    keys = np.arange(0, LAYOUT.total_rows, 3, dtype=np.int64)
    got = rows.fetch(keys, np.full(len(keys), -1)).result(10)
    direct = shards.direct_client()
    try:
        want = shards.io.run(direct.fetch(keys))
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_array_equal(got.state, want.state)
        np.testing.assert_array_equal(got.versions, want.versions)
        rows.release(got)

        new_rows = np.arange(len(keys) * DIM, dtype=np.float32).reshape(len(keys), DIM)
        new_state = np.full((len(keys), STATE_WIDTH), 0.5, np.float32)
        assert rows.write_back(keys, new_rows, new_state, 3, False).result(10) is None
        # a fetch that asks for version 3 is served once it has landed: what was written
        again = rows.fetch(keys, np.full(len(keys), 3)).result(10)
        np.testing.assert_array_equal(again.rows, new_rows)
        np.testing.assert_array_equal(again.state, new_state)
        assert (again.versions == 3).all()
        np.testing.assert_array_equal(shards.io.run(direct.fetch(keys)).rows, new_rows)
        rows.release(again)
    finally:
        shards.io.run(direct.close())


@pytest.fixture
def descriptors_past_1024() -> Iterator[None]:
    """Over a thousand descriptors open before the channel's socket is made, as in a trainer
    with many connections and files (select() cannot watch such a descriptor; poll can)."""
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] < 1100:
        held.append(os.dup(held[0]))
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)


def test_a_channel_whose_descriptor_is_past_1024_still_waits_and_reads(descriptors_past_1024: None,
                                                                       shards: Shards) -> None:
    assert shards.helper.rows._sock.fileno() >= 1024
    keys = np.arange(40, dtype=np.int64)
    got = shards.helper.rows.fetch(keys, np.full(len(keys), -1)).result(10)
    assert got.rows.shape == (40, DIM)
    shards.helper.rows.release(got)


@pytest.fixture
def gloo_garbage_at_fork() -> Iterator[None]:
    """Gloo groups that only the cycle collector can free when the helper is forked, as a
    test process leaves them (a sum that failed: its traceback holds them in a cycle).
    Collected in the helper, whose copy has none of their threads, their destructors crash."""
    groups, errors = gloo_groups(3, "garbage-at-fork", 0.5), {}
    errors["itself"] = errors  # a cycle: what holds the errors is freed by the collector alone

    def work(rank: int) -> None:
        if rank < 2:  # rank 2 never answers
            try:
                OrderedSum(groups[rank], torch.ones(300, 4), rank, 3, TRAINING_THREAD_TAG).wait()
            except RuntimeError as exc:
                errors[rank] = exc  # its traceback holds the group

    gc.disable()
    try:
        _run_ranks(3, work)
        del groups, errors
    finally:
        gc.enable()  # the helper is forked next, before allocations trigger a collection
    yield


def test_a_helper_forked_beside_garbage_of_gloo_groups_serves(gloo_garbage_at_fork: None, shards: Shards) -> None:
    got = shards.helper.rows.fetch(np.arange(40, dtype=np.int64), np.full(40, -1)).result(10)
    assert got.rows.shape == (40, DIM)
    shards.helper.rows.release(got)


def test_the_shared_memory_is_lent_again_once_released(shards: Shards) -> None:
    rows = shards.helper.rows
    keys = np.arange(40, dtype=np.int64)
    for _ in range(20):
        rows.release(rows.fetch(keys, np.full(len(keys), -1)).result(10))
    assert rows.pool.segments == 1
    held = [rows.fetch(keys, np.full(len(keys), -1)) for _ in range(3)]  # in flight together: three
    for future in held:
        rows.release(future.result(10))
    assert rows.pool.segments == 3


def test_errors_of_the_shards_are_raised_where_the_trainer_waits(shards: Shards) -> None:
    rows = shards.helper.rows
    with pytest.raises(BadRequest, match="outside"):
        rows.fetch(np.array([10**6], dtype=np.int64), np.array([-1])).result(10)
    with pytest.raises(TimedOut, match="PS shard .* did not reach their version"):
        rows.fetch(np.array([1], dtype=np.int64), np.array([5])).result(10)
    # and the channel goes on serving
    ok = rows.fetch(np.array([1], dtype=np.int64), np.array([-1])).result(10)
    assert ok.rows.shape == (1, DIM)


def test_done_reads_answers_without_waiting(shards: Shards) -> None:
    future = shards.helper.rows.fetch(np.array([2, 3], dtype=np.int64), np.array([-1, -1]))
    callbacks: list[bool] = []
    future.add_done_callback(lambda f: callbacks.append(True))
    while not future.done():  # asking is what reads the answer, on the asking thread
        pass
    assert callbacks == [True]


def test_the_control_calls_reach_the_helpers_client(shards: Shards) -> None:
    saved = shards.io.run(shards.helper.snapshot(4))
    assert [s.checkpoint for s in saved] == [4, 4]
    assert [svc.store.last_checkpoint for svc in shards.services] == [4, 4]


def test_a_helper_that_dies_fails_every_request_clearly(shards: Shards) -> None:
    rows = shards.helper.rows
    os.kill(shards.helper.pid, signal.SIGKILL)
    with pytest.raises(Unavailable, match="PS client process exited"):
        rows.fetch(np.array([1], dtype=np.int64), np.array([-1])).result(10)
    with pytest.raises(Unavailable):
        rows.write_back(np.array([1]), np.zeros((1, DIM), np.float32), np.zeros((1, 1), np.float32), 1, False).result(1)
    with pytest.raises(Unavailable, match="PS client process"):  # the I/O thread's calls too
        shards.io.run(shards.helper.snapshot(1))


def test_close_reaps_the_helper_and_kills_one_that_does_not_exit() -> None:
    for stopped in (False, True):
        helper = PsProcess.start(dim=DIM, state_width=STATE_WIDTH, wait_s=0.5)
        if stopped:  # it can answer nothing and exit never: close must kill it
            os.kill(helper.pid, signal.SIGSTOP)
        helper.close(timeout_s=1.0)
        with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
            os.waitpid(helper.pid, os.WNOHANG)


def test_a_pool_keeps_only_so_many_free_bytes() -> None:
    announced, forgotten = [], []
    pool = SegmentPool(lambda s, fd: announced.append(s.id), lambda s: forgotten.append(s.id), keep_bytes=3 << 16)
    taken = [pool.take(1 << 16) for _ in range(5)]
    assert announced == [0, 1, 2, 3, 4]
    for segment in taken:
        pool.give_back(segment)
    assert sorted(forgotten) == [3, 4] or len(forgotten) == 2
    again = pool.take(100)
    assert again.id in {0, 1, 2} and pool.segments == 5  # reused, none made
