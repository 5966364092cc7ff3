"""A trainer's records: the JSON lines it appends to ``RUN_DIR/trainer-<j>.jsonl``, and how
they are read back.

One JSON object a line, in the order written, each naming its ``kind``:

* `IterationRecord` (``"iter"``) once per iteration;
* `EvalRecord` (``"eval"``) after an evaluation, from rank 0 alone;
* `CheckpointRecord` (``"checkpoint"``) from rank 0 once a checkpoint is complete;
* `FinalRecord` (``"final"``) when the trainer is done;
* `MetricsRecord` (``"metrics"``) once its Prometheus scrape target listens;
* `ThreadsRecord` (``"threads"``) every few iterations: the CPU time of each of its threads.

The codec is the wire messages' pair (`ps.protocol`, `common.directive`): `to_wire()` gives
a record's line, without its newline (``kind`` first, then the fields in the order the
dataclass declares them, NaN as null); `record_from_wire` turns a line back into the record of
its kind, and each class's `from_wire` into a record of that class. The format grew over
time, and a line of an older trainer still reads: a field added later takes its default
(the payload bytes by kind read as 0, `compute_cpu` and `machinery_cpu` as empty, which
the report shows as n/a); a field this reader does not know is ignored, and so is a record of a kind it does not
know (a newer trainer's). A record that lacks a field every trainer wrote raises
`RecordError` naming it.

`RecordWriter` is the trainer's one writer; `read_records`, `read_run`, `RecordTail` and
`RunTail` read, whole or as the files grow. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self, TypeAlias

import orjson

from common.errors import BagpipeError

logger = logging.getLogger(__name__)


class RecordError(BagpipeError):
    """A record file shrank, or a line is not a record of its kind."""

    code = "records"


def _int(value: Any) -> int:
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError("an integer")


def _float(value: Any) -> float:
    """A number; null is NaN (JSON has no NaN: orjson writes it as null)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("a number")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def _seconds(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise TypeError("an object of numbers")
    return {str(k): _float(v) for k, v in value.items()}


#: How a field of each annotated type is read from its JSON value.
_READERS: Mapping[str, Callable[[Any], Any]] = {
    "int": _int, "float": _float, "str": _str, "dict[str, float]": _seconds,
}


class _Codec:
    """`to_wire`/`from_wire` for the record dataclasses below; `kind` names each in its line."""

    kind: ClassVar[str]

    def to_wire(self) -> bytes:
        """This record's line, without the newline."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return orjson.dumps({"kind": self.kind, **values}, option=orjson.OPT_SERIALIZE_NUMPY)

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        """The record of this class in `body`; RecordError if it holds another."""
        record = record_from_wire(body)
        if not isinstance(record, cls):
            raise RecordError(f"not a {cls.kind!r} record: {bytes(body[:60])!r}")
        return record

    @classmethod
    def _from_object(cls, value: Mapping[str, Any]) -> Self:
        missing = [f.name for f in fields(cls) if f.name not in value  # type: ignore[arg-type]
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            of = f" of iteration {value['iteration']}" if "iteration" in value else ""
            raise RecordError(f"{cls.kind!r} record{of} lacks {', '.join(missing)}", missing=missing)
        kwargs = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in value:
                try:
                    kwargs[f.name] = _READERS[str(f.type)](value[f.name])
                except TypeError as exc:
                    raise RecordError(f"{cls.kind!r} record: {f.name} is {value[f.name]!r}, not {exc}",
                                      field=f.name) from None
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class IterationRecord(_Codec):
    """One iteration of one trainer. `time` is unix seconds at its end; the counters are this
    trainer's (its slice of the global batch, the rows it used and moved); `phases` add up to
    the iteration (`trainer.timing.PHASES`), `compute_cpu` is the training thread's CPU time
    in each of `trainer.timing.COMPUTE_PHASES`, `machinery_cpu` in each of
    `trainer.timing.MACHINERY_PHASES`."""

    kind: ClassVar[str] = "iter"

    iteration: int
    time: float
    samples: int
    loss: float  # mean over the trainer's slice; NaN (null) when undefined
    uses: int  # unique rows used
    hits: int  # rows used that were resident before the iteration's fetches
    fetch_rows: int
    fetch_bytes: int  # rows and optimizer state fetched from the PS
    write_back_rows: int
    write_back_bytes: int
    sync_rows: int  # rows whose gradients were summed across trainers (now and later)
    sync_bytes: int  # sync_now_bytes + sync_later_bytes + join_bytes
    join_rows: int  # rows copied from another trainer's cache
    # Added later: 0 in the records of earlier trainers.
    sync_now_bytes: int = 0
    sync_later_bytes: int = 0
    join_bytes: int = 0
    dense_bytes: int = 0  # the dense gradients DDP all-reduces
    phases: dict[str, float] = field(default_factory=dict, hash=False)  # {} where a line lacks it
    # Added later: empty in the records of earlier trainers (the report shows n/a).
    compute_cpu: dict[str, float] = field(default_factory=dict, hash=False)
    machinery_cpu: dict[str, float] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, kw_only=True)
class EvalRecord(_Codec):
    """An evaluation over every trainer's predictions, written by rank 0: ``"progressive"``
    (the training predictions of the last `eval_every` iterations) or ``"held-out"``."""

    kind: ClassVar[str] = "eval"

    split: str
    iteration: int  # iterations trained when it was taken
    time: float
    auc: float  # NaN (null) when the labels hold one class only
    log_loss: float
    count: int


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord(_Codec):
    """Checkpoint `iteration` is complete (rank 0): `bytes` of PS snapshots and dense model,
    `seconds` from its last write-back being sent to its manifest."""

    kind: ClassVar[str] = "checkpoint"

    iteration: int
    time: float
    bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FinalRecord(_Codec):
    """The trainer is done: it trained `iterations`, evaluated and saved."""

    kind: ClassVar[str] = "final"

    time: float
    iterations: int


@dataclass(frozen=True, kw_only=True)
class MetricsRecord(_Codec):
    """The trainer's Prometheus scrape target listens at `url`."""

    kind: ClassVar[str] = "metrics"

    time: float
    url: str


@dataclass(frozen=True, kw_only=True)
class ThreadsRecord(_Codec):
    """CPU seconds each thread of the trainer process has used so far, by name
    (`trainer.threads`), when `iteration` iterations had been trained (the next one's index);
    written every few iterations."""

    kind: ClassVar[str] = "threads"

    iteration: int
    time: float
    cpu: dict[str, float] = field(hash=False)


@dataclass(frozen=True, kw_only=True)
class TermRecord(_Codec):
    """A trainer of an elastic job starts term `term` (`oracle.membership`): `trainers` train
    from `first_iteration`, and this trainer's records after it are that term's. The
    iterations from `first_iteration` that an earlier term trained were lost with it."""

    kind: ClassVar[str] = "term"

    term: int
    trainers: int
    first_iteration: int
    time: float


Record: TypeAlias = (IterationRecord | EvalRecord | CheckpointRecord | FinalRecord | MetricsRecord | ThreadsRecord
                     | TermRecord)
_KINDS: Mapping[str, type[_Codec]] = {
    cls.kind: cls
    for cls in (IterationRecord, EvalRecord, CheckpointRecord, FinalRecord, MetricsRecord, ThreadsRecord, TermRecord)
}

#: The integer counters of an `IterationRecord` that every record carries.
COUNTERS: tuple[str, ...] = (
    "samples", "uses", "hits", "fetch_rows", "fetch_bytes", "write_back_rows", "write_back_bytes",
    "sync_rows", "sync_bytes", "join_rows",
)
#: An `IterationRecord`'s payload bytes by what carries them (0 where a record predates them).
BYTE_KINDS: tuple[str, ...] = (
    "fetch_bytes", "write_back_bytes", "sync_now_bytes", "sync_later_bytes", "join_bytes", "dense_bytes",
)


def record_from_wire(body: bytes | bytearray | memoryview) -> Record | None:
    """The record one line holds; None for a kind this reader does not know. RecordError if
    the line is not a JSON object, or a record lacks a field or holds one of the wrong type."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise RecordError(f"not a JSON object: {bytes(body[:60])!r}")
    return _from_object(value)


def _from_object(value: Mapping[str, Any]) -> Record | None:
    cls = _KINDS.get(value["kind"]) if isinstance(value.get("kind"), str) else None
    return None if cls is None else cls._from_object(value)


# --------------------------------------------------------------------------- writing


class RecordWriter:
    """Appends one trainer's records to its file, a line each, flushed at once (the launcher
    reads them live). Safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")
        self._lock = threading.Lock()  # iterations are logged by the main thread, checkpoints by I/O

    def write(self, record: Record) -> None:
        line = record.to_wire() + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------- reading


def trainer_log_path(run_dir: str | os.PathLike[str], trainer: int) -> Path:
    """Where trainer `trainer` of the run in `run_dir` writes its records."""
    return Path(run_dir) / f"trainer-{trainer}.jsonl"


def _parse_lines(data: bytes, source: str, first_line: int) -> tuple[list[Record], int, int]:
    """Parse the complete lines at the start of `data`.

    Returns the records, the bytes consumed and the lines consumed. A trailing piece without
    a newline counts as complete only if it parses as a JSON object: a record cut short never
    does, since its closing brace comes last. A complete line that is not a JSON object (a
    line torn by a crash, then appended to) is skipped with a warning naming it; a record of
    an unknown kind is skipped; one that does not read raises `RecordError` naming its line.
    """
    records: list[Record] = []
    consumed = 0
    line_no = first_line
    while consumed < len(data):
        end = data.find(b"\n", consumed)
        last = end < 0
        raw = data[consumed:] if last else data[consumed:end]
        if raw.strip():
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError:
                value = None
            if last and not isinstance(value, dict):
                break  # still being written
            if isinstance(value, dict):
                try:
                    record = _from_object(value)
                except RecordError as exc:
                    raise RecordError(f"{source}:{line_no}: {exc.message}", path=source, line=line_no,
                                      **exc.fields) from None
                if record is not None:
                    records.append(record)
            else:
                logger.warning("%s:%d: skipping a line that is not a JSON object", source, line_no)
        consumed = len(data) if last else end + 1
        line_no += 0 if last else 1
    return records, consumed, line_no - first_line


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """All complete records of one trainer's file, in file order.

    An unfinished last line (the trainer is still writing it) is left out.
    Raises FileNotFoundError if the file does not exist.
    """
    data = Path(path).read_bytes()
    return _parse_lines(data, str(path), 1)[0]


def read_run(run_dir: str | os.PathLike[str], trainers: int) -> dict[int, list[Record]]:
    """Records of trainers 0..trainers-1; a trainer without a file gets an empty list, so that
    a summary can name every missing trainer at once."""
    out: dict[int, list[Record]] = {}
    for j in range(trainers):
        path = trainer_log_path(run_dir, j)
        out[j] = read_records(path) if path.exists() else []
    return out


class RecordTail:
    """Follows one growing record file: each `poll()` returns the records completed since the
    previous poll. Keeps the byte offset of the first unread line; a file that does not exist
    yet gives no records. A file that shrinks (a new run started in the same directory) raises
    `RecordError`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._line = 1

    @property
    def offset(self) -> int:
        """Bytes of the file already turned into records."""
        return self._offset

    def poll(self) -> list[Record]:
        """New complete records since the last poll (possibly none)."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:
                    raise RecordError(
                        f"{self.path} shrank from {self._offset} to {size} bytes; "
                        "was a new run started in the same directory?",
                        path=str(self.path),
                    )
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        records, consumed, lines = _parse_lines(data, str(self.path), self._line)
        self._offset += consumed
        self._line += lines
        return records


def terms_of(records_by_trainer: Mapping[int, Sequence[Record]]) -> list[TermRecord]:
    """Every term of an elastic run once, in order (the first trainer's record of each)."""
    first: dict[int, TermRecord] = {}
    for records in records_by_trainer.values():
        for r in records:
            if isinstance(r, TermRecord) and (r.term not in first or r.time < first[r.term].time):
                first[r.term] = r
    return [first[t] for t in sorted(first)]


def within_last_term(records_by_trainer: Mapping[int, Sequence[Record]]) -> dict[int, list[Record]]:
    """An elastic run's records as if its last term had been the whole run: its trainers
    only, each with the records it wrote after it started that term (a run summary lines up
    the iterations of one set of trainers, and a process's CPU counts from its own start).
    A run with no term records is as it is."""
    terms = terms_of(records_by_trainer)
    if not terms:
        return {j: list(records) for j, records in records_by_trainer.items()}
    last = terms[-1]
    out: dict[int, list[Record]] = {}
    for j, records in records_by_trainer.items():
        starts = [k for k, r in enumerate(records) if isinstance(r, TermRecord) and r.term == last.term]
        if j < last.trainers:
            out[j] = list(records[starts[-1] + 1:]) if starts else []
    return out


class RunTail:
    """`RecordTail`s of all trainers of a run; `poll()` gives {trainer: new records}."""

    def __init__(self, run_dir: str | os.PathLike[str], trainers: int) -> None:
        self._tails = {j: RecordTail(trainer_log_path(run_dir, j)) for j in range(trainers)}

    def poll(self) -> dict[int, list[Record]]:
        """New complete records of every trainer since the last poll."""
        return {j: tail.poll() for j, tail in self._tails.items()}
