"""A trainer's records as it writes them to ``trainer-<j>.jsonl``.

`write_trainer_run` drives the trainer's own record-writing code (`trainer.reporting`, `trainer.checkpointer`) with fixed
inputs and a fixed clock: a run of two trainers and 30 iterations whose process died after
iteration 21 and resumed after checkpoint 19, so iterations 20 and 21 are logged twice. The
files it wrote at the commit before records became dataclasses are kept in
``tests/trainer/fixtures/run``: the trainer must keep writing exactly those bytes, so that a
run folder written before reads as before (the launcher's report reads the same files,
`tests/launcher/test_golden.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from trainer import checkpointer, reporting
from trainer.checkpointer import Checkpointer
from trainer.engine import IterationStats
from trainer.evaluation import MetricAccumulator
from trainer.records import (
    BYTE_KINDS,
    COUNTERS,
    CheckpointRecord,
    EvalRecord,
    FinalRecord,
    IterationRecord,
    MetricsRecord,
    Record,
    RecordError,
    RecordTail,
    RecordWriter,
    RunTail,
    read_records,
    read_run,
    record_from_wire,
    trainer_log_path,
)
from trainer.timing import COMPUTE_PHASES, MACHINERY_PHASES, PHASES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN = FIXTURES / "run"
ITERATIONS = 30
BATCH = 128  # per trainer
ROW_BYTES, GRAD_BYTES, DENSE_BYTES = 4 * (16 + 16), 4 * 16, 4 * 9_841
START = 1_700_000_000.0


class Clock:
    """`time.time` and `time.perf_counter` for `trainer.reporting` and `trainer.checkpointer`: set by hand, read by the code."""

    def __init__(self) -> None:
        self.now = START
        self.perf = 0.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.perf


class FixedTimer:
    """The phase timer an engine hands `iteration_record`, with preset phases."""

    def __init__(self, phases: dict[str, float], cpu: dict[str, float]) -> None:
        self._phases, self.compute_cpu = phases, cpu
        # Half of each machinery phase's wall time (no draw: the other figures stay as they were)
        self.machinery_cpu = {p: phases[p] / 2 for p in MACHINERY_PHASES}

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
        with mock.patch.object(reporting, "time", clock):
            record = reporting.iteration_record(stats, engine, ROW_BYTES, GRAD_BYTES, DENSE_BYTES)  # type: ignore[arg-type]
        records.write(record)


def _eval(rng: np.random.Generator, j: int, iteration: int, split: str, clock: Clock, records: RecordWriter,
          one_class: bool = False) -> None:
    """What `record_eval` writes at `iteration` on rank `j` (rank 0 alone writes)."""
    parts = []
    for _ in range(2):
        labels = np.zeros(200) if one_class else (rng.uniform(size=200) < 0.25).astype(np.float64)
        parts.append((labels, np.clip(0.25 + 0.3 * (labels - 0.25) + rng.normal(0, 0.2, 200), 0.01, 0.99)))
    acc = MetricAccumulator()
    acc.add(*parts[j])
    comm = SimpleNamespace(rank=j, all_gather_objects=lambda _: parts)
    with mock.patch.object(reporting, "time", SimpleNamespace(time=lambda: clock.now + 0.01)):
        reporting.record_eval(records, comm, acc, iteration, split=split)  # type: ignore[arg-type]


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
    with mock.patch.object(checkpointer, "time", fake):
        asyncio.run(checkpoints._report(c, []))


def _line(record: Record, clock: Clock, records: RecordWriter) -> None:
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
                _line(MetricsRecord(time=clock.now, url=url), clock, records)
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
            _line(FinalRecord(time=clock.now, iterations=ITERATIONS), clock, records)
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


# --------------------------------------------------------------------------- the codec


def test_every_line_the_trainer_wrote_reads_back_and_writes_the_same_bytes() -> None:
    kinds = set()
    for name, line in fixture_lines():
        record = record_from_wire(line)
        assert record is not None, (name, line)
        assert record.to_wire() == line, name
        assert type(record).from_wire(line) == record  # a null reads as math.nan itself: equal
        kinds.add(type(record))
    assert kinds == {IterationRecord, EvalRecord, CheckpointRecord, FinalRecord, MetricsRecord}


def test_nan_is_written_as_null_and_read_back_as_nan() -> None:
    record = EvalRecord(split="progressive", iteration=10, time=1.5, auc=math.nan, log_loss=0.25, count=4)
    assert record.to_wire() == (b'{"kind":"eval","split":"progressive","iteration":10,"time":1.5,"auc":null,'
                                b'"log_loss":0.25,"count":4}')
    back = EvalRecord.from_wire(record.to_wire())
    assert math.isnan(back.auc) and back.log_loss == 0.25


def test_a_record_of_an_older_trainer_takes_the_defaults_of_what_it_lacks() -> None:
    line = (b'{"kind":"iter","iteration":3,"time":2.0,"samples":64,"loss":null,"uses":4,"hits":2,"fetch_rows":1,'
            b'"fetch_bytes":68,"write_back_rows":0,"write_back_bytes":0,"sync_rows":0,"sync_bytes":0,'
            b'"join_rows":0,"phases":{"forward":0.5}}')
    record = IterationRecord.from_wire(line)
    assert (record.sync_now_bytes, record.sync_later_bytes, record.join_bytes, record.dense_bytes) == (0, 0, 0, 0)
    assert record.compute_cpu == {} and record.machinery_cpu == {} and record.phases == {"forward": 0.5}
    assert math.isnan(record.loss)


def test_unknown_fields_are_ignored_and_unknown_kinds_read_as_none() -> None:
    assert record_from_wire(b'{"kind":"final","time":1.0,"iterations":3,"host":"tr0"}') == FinalRecord(
        time=1.0, iterations=3)
    assert record_from_wire(b'{"kind":"profile","time":1.0}') is None
    assert record_from_wire(b'{"time":1.0}') is None


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (b'{"kind":"checkpoint","iteration":9,"time":1.0,"seconds":0.5}', "'checkpoint' record of iteration 9 lacks bytes"),
        (b'{"kind":"final","time":"soon","iterations":3}', "'final' record: time is 'soon', not a number"),
        (b'{"kind":"final","time":1.0,"iterations":2.5}', "iterations is 2.5, not an integer"),
        (b'{"kind":"metrics","time":1.0,"url":null}', "url is None, not a string"),
        (b'[1, 2]', "not a JSON object"),
    ],
)
def test_a_line_that_is_not_a_record_is_named(line: bytes, match: str) -> None:
    with pytest.raises(RecordError, match=match):
        record_from_wire(line)


def test_from_wire_of_a_class_refuses_another_kind() -> None:
    with pytest.raises(RecordError, match="not a 'eval' record"):
        EvalRecord.from_wire(FinalRecord(time=1.0, iterations=3).to_wire())


def test_the_counters_and_byte_kinds_are_fields_of_an_iteration_record() -> None:
    names = {f.name for f in dataclasses.fields(IterationRecord)}
    assert set(COUNTERS) <= names and set(BYTE_KINDS) <= names


# --------------------------------------------------------------------------- reading


def it_rec(iteration: int, time: float) -> IterationRecord:
    return IterationRecord(iteration=iteration, time=time, loss=0.5, **dict.fromkeys(COUNTERS, 1))


def line(record: Record) -> bytes:
    return record.to_wire() + b"\n"


def test_an_old_run_folder_reads_as_before(caplog: pytest.LogCaptureFixture) -> None:
    """The older trainer's file: its torn line is skipped with a warning, its unknown kind
    and unfinished last line left out."""
    path = trainer_log_path(FIXTURES / "old-run", 0)
    with caplog.at_level(logging.WARNING):
        records = read_records(path)
    assert f"{path}:8: skipping a line that is not a JSON object" in caplog.text
    assert [type(r).__name__ for r in records] == ["IterationRecord"] * 6 + ["EvalRecord"] + [
        "IterationRecord"] * 6 + ["EvalRecord", "FinalRecord"]
    assert [r.iteration for r in records if isinstance(r, IterationRecord)] == list(range(12))


def test_read_records_ignores_an_unfinished_last_line(tmp_path: Path) -> None:
    path = tmp_path / "trainer-0.jsonl"
    whole = line(it_rec(0, 1.0)) + line(it_rec(1, 2.0))
    path.write_bytes(whole + line(it_rec(2, 3.0))[:25])
    assert read_records(path) == [it_rec(0, 1.0), it_rec(1, 2.0)]
    path.write_bytes(whole + line(it_rec(2, 3.0))[:-1])  # complete object, newline not yet
    assert read_records(path) == [it_rec(0, 1.0), it_rec(1, 2.0), it_rec(2, 3.0)]


def test_a_torn_line_in_the_middle_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "trainer-0.jsonl"
    path.write_bytes(line(it_rec(0, 1.0)) + b'{"kind": "it\n' + line(it_rec(1, 2.0)))
    with caplog.at_level(logging.WARNING):
        assert [r.iteration for r in read_records(path)] == [0, 1]  # type: ignore[union-attr]
    assert f"{path}:2" in caplog.text


def test_a_record_that_does_not_read_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trainer-0.jsonl"
    path.write_bytes(line(it_rec(0, 1.0)) + line(it_rec(1, 2.0)).replace(b'"hits":1,', b""))
    with pytest.raises(RecordError, match=f"{path}:2: 'iter' record of iteration 1 lacks hits"):
        read_records(path)


def test_record_tail_returns_each_record_once_as_it_completes(tmp_path: Path) -> None:
    path = tmp_path / "trainer-0.jsonl"
    tail = RecordTail(path)
    assert tail.poll() == []  # not created yet
    a, b, c = line(it_rec(0, 1.0)), line(it_rec(1, 2.0)), line(it_rec(2, 3.0))
    pieces = [a + b[:10], b[10:30], b[30:], c[:-1], b"\n", b""]
    seen = []
    with open(path, "ab") as f:
        for piece in pieces:
            f.write(piece)
            f.flush()
            seen.append([r.iteration for r in tail.poll()])  # type: ignore[union-attr]
    assert seen == [[0], [], [1], [2], [], []]
    assert tail.offset == len(a + b + c)


def test_record_tail_rejects_a_file_that_shrank(tmp_path: Path) -> None:
    path = tmp_path / "trainer-0.jsonl"
    path.write_bytes(line(it_rec(0, 1.0)))
    tail = RecordTail(path)
    tail.poll()
    path.write_bytes(b"")
    with pytest.raises(RecordError, match="shrank"):
        tail.poll()


def test_read_run_and_run_tail_cover_every_trainer(tmp_path: Path) -> None:
    trainer_log_path(tmp_path, 0).write_bytes(line(it_rec(0, 1.0)))
    assert read_run(tmp_path, 2) == {0: [it_rec(0, 1.0)], 1: []}
    tail = RunTail(tmp_path, 2)
    assert tail.poll() == {0: [it_rec(0, 1.0)], 1: []}
    trainer_log_path(tmp_path, 1).write_bytes(line(it_rec(0, 1.5)))
    assert tail.poll() == {0: [], 1: [it_rec(0, 1.5)]}


def test_the_writer_appends_a_line_a_record(tmp_path: Path) -> None:
    path = tmp_path / "run" / "trainer-0.jsonl"
    for records in ([it_rec(0, 1.0)], [it_rec(1, 2.0), FinalRecord(time=3.0, iterations=2)]):
        writer = RecordWriter(path)  # a resumed trainer appends
        for record in records:
            writer.write(record)
        writer.close()
    assert read_records(path) == [it_rec(0, 1.0), it_rec(1, 2.0), FinalRecord(time=3.0, iterations=2)]
