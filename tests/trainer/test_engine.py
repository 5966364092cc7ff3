"""The engine's bookkeeping of write-backs: a failed one surfaces at the next boundary, not
WRITE_LAG iterations later, and acknowledged ones are not asked about again."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.errors import Unavailable
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import StoreRows, lone_engine, plan_steps, store_rows
from tests.cluster_helpers import write_spec
from tests.trainer.test_collectives import gloo_groups
from trainer.collectives import Collectives, peers_unreachable
from trainer.engine import Engine, request_result


class CountingRows:
    """`StoreRows` whose write-back number `fail_at` fails, counting how often the engine asks
    whether a write-back is done."""

    def __init__(self, rows: StoreRows, fail_at: int | None = None) -> None:
        self._rows, self._fail_at = rows, fail_at
        self.writes, self.asked = 0, 0

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> concurrent.futures.Future:
        return self._rows.fetch(keys, min_versions)

    def release(self, fetched: Any) -> None:
        self._rows.release(fetched)

    def write_back(self, *args: Any) -> concurrent.futures.Future:
        self.writes += 1
        outer = _Counted(self)
        if self.writes == self._fail_at:
            outer.set_exception(Unavailable("shard 0 refused the write-back"))
        else:
            outer.set_result(self._rows.write_back(*args).result())
        return outer


class _Counted(concurrent.futures.Future):
    def __init__(self, rows: CountingRows) -> None:
        super().__init__()
        self._counter = rows

    def done(self) -> bool:
        self._counter.asked += 1
        return super().done()


def engine_and_steps(tmp_path: Path, fail_at: int | None) -> tuple[Engine, Collectives, list, CountingRows]:
    spec = write_spec(tmp_path, "engine", {"oracle": {"mode": "bagpipe", "cache_rows": 140},
                                           "trainers": {"count": 1}, "train": {"max_iterations": 60}})
    job = build_job(load_spec(spec))
    steps = [s[0] for s in plan_steps(job)]
    rows = CountingRows(store_rows(job), fail_at)
    engine, comm = lone_engine(job, rows, f"engine-{fail_at}")
    return engine, comm, steps, rows


def test_a_failed_write_back_surfaces_at_the_next_boundary(tmp_path: Path) -> None:
    engine, comm, steps, rows = engine_and_steps(tmp_path, fail_at=3)
    sent = []  # write-backs sent by the end of each step that completed
    with pytest.raises(Unavailable, match="refused the write-back"):
        for step in steps:
            engine.step(step.directive, step.labels, step.dense)
            sent.append(rows.writes)
    comm.close()
    # the step that sent it completed; the next one raised at its boundary
    assert sent[-1] >= 3 and (len(sent) == 1 or sent[-2] < 3), sent


def test_acknowledged_write_backs_are_not_asked_about_again(tmp_path: Path) -> None:
    engine, comm, steps, rows = engine_and_steps(tmp_path, fail_at=None)
    for step in steps:
        engine.step(step.directive, step.labels, step.dense)
    engine.drain()
    comm.close()
    assert rows.writes >= 50, rows.writes  # about one an iteration
    # each once when done (and once more by the drain), where each boundary asked about every
    # write-back of the last WRITE_LAG iterations
    assert rows.asked <= 2 * rows.writes, (rows.asked, rows.writes)


def _waited(future: concurrent.futures.Future, comm: Collectives, limit_s: float) -> tuple[Any, BaseException | None]:
    """`request_result(future, comm)` on a thread of its own, given at most `limit_s`."""
    outcome: list[tuple[Any, BaseException | None]] = []

    def wait() -> None:
        try:
            outcome.append((request_result(future, comm), None))
        except BaseException as exc:  # noqa: BLE001  (what the test looks at)
            outcome.append((None, exc))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(limit_s)
    assert outcome, f"the wait did not end within {limit_s} s"
    return outcome[0]


def test_a_wait_for_the_ps_ends_with_the_error_of_a_background_sum_that_failed() -> None:
    """Trainer 0's sync_later sum fails (trainer 1 is gone) while its training thread waits
    for a PS request only trainer 1 could have answered (a prefetch at the version trainer 1
    was to write back): the wait ends with the sum's error, within the group's timeout, and
    the trainer reports its peer, not a PS that timed out fetch_timeout_s later."""
    world, timeout_s = 2, 1.0
    groups = gloo_groups(world, "gone-peer", timeout_s)
    comm = Collectives(world_size=world, rank=0, group=groups[0], background=groups[0])
    try:
        answered: concurrent.futures.Future = concurrent.futures.Future()
        answered.set_result("rows")
        assert _waited(answered, comm, 5) == ("rows", None)
        own_error: concurrent.futures.Future = concurrent.futures.Future()
        own_error.set_exception(TimeoutError("the PS's own"))
        assert str(_waited(own_error, comm, 5)[1]) == "the PS's own"

        comm.sum_rows(torch.ones(64, 4), background=True)  # trainer 1 never starts its half
        _, error = _waited(concurrent.futures.Future(), comm, 10 * timeout_s)  # answered by no one
        assert isinstance(error, RuntimeError)
        assert peers_unreachable(error, 0, world, timeout_s) is not None, error
    finally:
        comm.close()
