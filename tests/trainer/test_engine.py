"""The engine's bookkeeping of write-backs: a failed one surfaces at the next boundary, not
WRITE_LAG iterations later, and acknowledged ones are not asked about again."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.errors import Unavailable
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import StoreRows, lone_engine, plan_steps, store_rows
from tests.cluster_helpers import write_spec
from trainer.collectives import Collectives
from trainer.engine import Engine


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
