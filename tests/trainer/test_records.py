"""A trainer's records as it writes them to ``trainer-<j>.jsonl``.

`write_trainer_run` drives the trainer's own record-writing code (`trainer.main`) with fixed
inputs and a fixed clock: a run of two trainers and 30 iterations whose process died after
iteration 21 and resumed after checkpoint 19, so iterations 20 and 21 are logged twice. The
files it wrote at the commit before records became dataclasses are kept in
``tests/trainer/fixtures/run``: the trainer must keep writing exactly those bytes, so that a
run folder written before reads as before (the launcher's report reads the same files,
`tests/launcher/test_golden.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np

from trainer import main
from trainer.engine import IterationStats
from trainer.main import Checkpointer, RecordWriter
from trainer.metrics import MetricAccumulator
from trainer.timing import COMPUTE_PHASES, PHASES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN = FIXTURES / "run"
ITERATIONS = 30
BATCH = 128  # per trainer
ROW_BYTES, GRAD_BYTES, DENSE_BYTES = 4 * (16 + 16), 4 * 16, 4 * 9_841
START = 1_700_000_000.0


class Clock:
    """`time.time` and `time.perf_counter` for `trainer.main`: set by hand, read by the code."""

    def __init__(self) -> None:
        self.now = START
        self.perf = 0.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.perf


class FixedTimer:
    """The phase timer an engine hands `_iteration_record`, with preset phases."""

    def __init__(self, phases: dict[str, float], cpu: dict[str, float]) -> None:
        self._phases, self.compute_cpu = phases, cpu

    def end_iteration(self) -> dict[str, float]:
        return self._phases


def _iterations(rng: np.random.Generator, j: int, first: int, last: int, restart_s: float, clock: Clock,
                records: RecordWriter) -> None:
    for x in range(first, last + 1):
        # The trainers end an iteration together (its collectives), trainer 1 a little later.
        clock.now = START + 0.03 * x + 0.004 * math.sin(x) + 0.0005 * j + restart_s
        phases = {p: float(rng.gamma(2.0, 0.0015)) for p in PHASES}
        phases["forward"], phases["backward"] = float(rng.normal(0.005, 0.0005)), float(rng.normal(0.011, 0.001))
        cpu = {p: phases[p] * float(rng.uniform(0.8, 1.0)) for p in COMPUTE_PHASES}
        uses = int(rng.integers(900, 1100))
        stats = IterationStats(
            iteration=x, samples=BATCH, loss=float(0.69 - 0.006 * x + rng.normal(0, 0.01)), uses=uses,
            hits=int(uses * min(0.9, 0.05 * x + rng.uniform(0, 0.1))), fetch_rows=int(rng.integers(300, 700)),
            write_back_rows=int(rng.integers(250, 650)), sync_now_rows=int(rng.integers(100, 300)),
            sync_later_rows=int(rng.integers(0, 150)), join_rows=int(rng.integers(0, 90)),
        )
        engine = SimpleNamespace(timer=FixedTimer(phases, cpu))
        with mock.patch.object(main, "time", clock):
            record = main._iteration_record(stats, engine, ROW_BYTES, GRAD_BYTES, DENSE_BYTES)  # type: ignore[arg-type]
        records.write(record)


def _eval(rng: np.random.Generator, j: int, iteration: int, split: str, clock: Clock, records: RecordWriter,
          one_class: bool = False) -> None:
    """What `_record_eval` writes at `iteration` on rank `j` (rank 0 alone writes)."""
    parts = []
    for _ in range(2):
        labels = np.zeros(200) if one_class else (rng.uniform(size=200) < 0.25).astype(np.float64)
        parts.append((labels, np.clip(0.25 + 0.3 * (labels - 0.25) + rng.normal(0, 0.2, 200), 0.01, 0.99)))
    acc = MetricAccumulator()
    acc.add(*parts[j])
    comm = SimpleNamespace(rank=j, all_gather_objects=lambda _: parts)
    with mock.patch.object(main, "time", SimpleNamespace(time=lambda: clock.now + 0.01)):
        main._record_eval(records, comm, acc, iteration, split=split)  # type: ignore[arg-type]


def _checkpoint(c: int, clock: Clock, records: RecordWriter) -> None:
    """What `Checkpointer` records once checkpoint `c` is complete (rank 0)."""
    answers = [SimpleNamespace(nbytes=1_000_000 + 17 * c), SimpleNamespace(nbytes=1_000_000 + 29 * c)]
    ps = SimpleNamespace(report_checkpoint=mock.AsyncMock(return_value=answers))
    coordinator = SimpleNamespace(complete_checkpoint=mock.AsyncMock(return_value=[c]))
    job = SimpleNamespace(spec=SimpleNamespace(trainers=SimpleNamespace(count=2)))
    checkpoints = Checkpointer(job, 0, None, ps, coordinator, records)  # type: ignore[arg-type]
    checkpoints._dense[c] = b"d" * (39_364 + c)
    perf = iter([clock.perf, clock.perf + 0.125 + c / 1024])
    # Complete off the critical path, a little after the next iteration started.
    fake = SimpleNamespace(time=lambda: clock.now + 0.02, perf_counter=lambda: next(perf))
    with mock.patch.object(main, "time", fake):
        asyncio.run(checkpoints._report(c, []))


def _line(record: dict, clock: Clock, records: RecordWriter) -> None:
    clock.now += 0.01
    records.write(record)


def write_trainer_run(run_dir: Path) -> None:
    """The run described in the module docstring, into `run_dir` (``trainer-0.jsonl`` and
    ``trainer-1.jsonl``)."""
    for j in range(2):
        rng = np.random.default_rng(28 + j)
        clock = Clock()
        records = RecordWriter(run_dir / f"trainer-{j}.jsonl")
        try:
            for first, last in ((0, 21), (20, ITERATIONS - 1)):  # died after 21, resumed after 19
                restart_s = 1.5 if first else 0.0  # the resumed process starts 1.5 s later
                clock.now = START - 0.5 + restart_s
                url = f"http://127.0.0.1:{9105 + j}/metrics"
                _line({"kind": "metrics", "time": clock.now, "url": url}, clock, records)
                for x in itertools.count(first, 10):
                    if x > last:
                        break
                    stop = min(x - x % 10 + 9, last)
                    _iterations(rng, j, x, stop, restart_s, clock, records)
                    if (stop + 1) % 10 == 0:
                        _eval(rng, j, stop + 1, "progressive", clock, records, one_class=stop == 9)
                        if j == 0:
                            _checkpoint(stop, clock, records)
            _eval(rng, j, ITERATIONS, "held-out", clock, records)
            _line({"kind": "final", "time": clock.now, "iterations": ITERATIONS}, clock, records)
        finally:
            records.close()


def fixture_lines() -> Iterator[tuple[str, bytes]]:
    for path in sorted(RUN.glob("trainer-*.jsonl")):
        for line in path.read_bytes().splitlines():
            yield path.name, line


def test_the_trainer_writes_its_records_byte_for_byte_as_before(tmp_path: Path) -> None:
    write_trainer_run(tmp_path)
    for j in range(2):
        name = f"trainer-{j}.jsonl"
        assert (tmp_path / name).read_bytes() == (RUN / name).read_bytes(), name
