"""A run's summary, computed from its trainers' records (`trainer.records`), and its JSON.

`iteration_series` lines the records up by iteration, as (trainers, iterations) arrays of
counters, loss, phase and CPU seconds, beside the combined evaluations; `summarise` turns
them into the `RunSummary` a user compares across runs and modes; `write_report` writes a
summary as ``report.json``. Nothing here prints or draws: `launcher.text` formats a summary,
`launcher.plots` draws a run, `launcher.progress` follows one as its records come in.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from common.errors import BagpipeError
from common.files import write_atomically
from trainer.records import (
    BYTE_KINDS,
    COUNTERS,
    CheckpointRecord,
    EvalRecord,
    FinalRecord,
    IterationRecord,
    Record,
    ThreadsRecord,
)
from trainer.threads import HELPER_PREFIX, TRAINING
from trainer.timing import COMPUTE_PHASES, MACHINERY_PHASES, PHASES

logger = logging.getLogger(__name__)

_OPTIONAL_COUNTERS = tuple(k for k in BYTE_KINDS if k not in COUNTERS)


class ReportError(BagpipeError):
    """Trainer records are missing, inconsistent or too few for the figure asked for."""

    code = "report"


# --------------------------------------------------------------------------- series


@dataclass(frozen=True, kw_only=True)
class EvalPoint:
    """One evaluation, combined across the trainers that reported it.

    `log_loss` is the count-weighted mean (exact); `auc` the count-weighted mean of the
    trainers' AUCs (exact when one trainer evaluates the whole set, an approximation when
    each evaluates a slice); NaN when no trainer's AUC is defined.
    """

    iteration: int
    time: float
    auc: float
    log_loss: float
    count: int


@dataclass(frozen=True, kw_only=True, eq=False)
class IterationSeries:
    """Per-iteration figures of the iterations every trainer has finished.

    Arrays are indexed ``[trainer_position, k]`` for the k-th common iteration (shape (T, N));
    `trainers[p]` is the trainer at position p. A resumed trainer may log an iteration twice:
    its last record wins.
    """

    trainers: tuple[int, ...]
    iterations: np.ndarray  # (N,) int64, ascending
    end_time: np.ndarray  # (N,) float64: when the slowest trainer finished the iteration
    counters: dict[str, np.ndarray]  # name -> (T, N) float64
    loss: np.ndarray  # (T, N) float64
    phases: dict[str, np.ndarray]  # name -> (T, N) float64 seconds
    compute_cpu: dict[str, np.ndarray]  # COMPUTE_PHASES name -> (T, N) CPU seconds, NaN if unknown
    evals: tuple[EvalPoint, ...]  # ascending iteration
    finished: bool  # every trainer wrote its final record

    def global_counter(self, name: str) -> np.ndarray:
        """Counter `name` summed across trainers, per iteration: (N,)."""
        return self.counters[name].sum(axis=0)


def _iteration_records(records: Iterable[Record]) -> dict[int, IterationRecord]:
    return {rec.iteration: rec for rec in records if isinstance(rec, IterationRecord)}


def _check_trainers(
    per_trainer: Mapping[int, dict[int, IterationRecord]], trainers: int | None
) -> tuple[int, ...]:
    if not per_trainer and not trainers:
        raise ReportError("no trainer records at all")
    expected = range(trainers if trainers is not None else max(per_trainer) + 1)
    unexpected = sorted(set(per_trainer) - set(expected))
    if unexpected:
        raise ReportError(
            f"records from trainer(s) {_join(unexpected)} outside 0..{len(expected) - 1}",
            trainers=unexpected,
        )
    empty = [j for j in expected if not per_trainer.get(j)]
    if empty:
        raise ReportError(
            f"no iteration records from trainer(s) {_join(empty)} "
            f"(expected trainers 0..{len(expected) - 1})",
            trainers=empty,
        )
    return tuple(expected)


def _combine_evals(records_by_trainer: Mapping[int, Sequence[Record]]) -> tuple[EvalPoint, ...]:
    latest: dict[tuple[int, int], EvalRecord] = {}  # (iteration, trainer) -> last record
    for j, records in records_by_trainer.items():
        for rec in records:
            if isinstance(rec, EvalRecord):
                latest[(rec.iteration, j)] = rec
    by_iteration: dict[int, list[EvalRecord]] = {}
    for (it, _), rec in sorted(latest.items()):
        by_iteration.setdefault(it, []).append(rec)
    points = []
    for it, recs in by_iteration.items():
        counts = np.array([float(r.count) for r in recs])
        weights = counts if counts.sum() > 0 else np.ones_like(counts)
        aucs = np.array([r.auc for r in recs])
        ok = ~np.isnan(aucs)
        has_auc = weights[ok].sum() > 0
        auc = float(np.average(aucs[ok], weights=weights[ok])) if has_auc else math.nan
        log_loss = float(np.average([r.log_loss for r in recs], weights=weights))
        when = max(r.time for r in recs)
        points.append(EvalPoint(iteration=it, time=when, auc=auc, log_loss=log_loss,
                                count=int(counts.sum())))
    return tuple(points)


def iteration_series(
    records_by_trainer: Mapping[int, Sequence[Record]], *, trainers: int | None = None
) -> IterationSeries:
    """Arrange the records of a run by iteration.

    Trainers are expected to be 0..trainers-1 (default: 0..the highest key); raises
    `ReportError` naming every expected trainer that has no iteration record, or naming keys
    outside that range. Only iterations that every trainer has logged are kept, so a run still
    in progress gives the iterations done so far.
    """
    per_trainer = {j: _iteration_records(recs) for j, recs in records_by_trainer.items()}
    order = _check_trainers(per_trainer, trainers)
    common = set.intersection(*(set(per_trainer[j]) for j in order))
    iterations = np.array(sorted(common), dtype=np.int64)
    rows = [[per_trainer[j][int(it)] for it in iterations] for j in order]

    def grid(get: Callable[[IterationRecord], float]) -> np.ndarray:
        return np.array([[get(r) for r in row] for row in rows], dtype=np.float64).reshape(
            len(order), len(iterations)
        )

    names = list(PHASES) + sorted(
        {p for row in rows for r in row for p in r.phases} - set(PHASES)
    )
    times = grid(lambda r: r.time)
    return IterationSeries(
        trainers=order,
        iterations=iterations,
        end_time=times.max(axis=0) if len(iterations) else np.zeros(0),
        counters={
            c: grid(lambda r, c=c: getattr(r, c)) for c in (*COUNTERS, *_OPTIONAL_COUNTERS)
        },
        loss=grid(lambda r: r.loss),
        phases={p: grid(lambda r, p=p: r.phases.get(p, 0.0)) for p in names},
        compute_cpu={p: grid(lambda r, p=p: r.compute_cpu.get(p, math.nan)) for p in COMPUTE_PHASES},
        evals=_combine_evals(records_by_trainer),
        finished=all(
            any(isinstance(r, FinalRecord) for r in records_by_trainer.get(j, ())) for j in order
        ),
    )


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """The figures of one run that a user compares across runs and modes.

    Timing covers the iterations after `warmup` and before the last `cooldown`: it runs from
    the end of the last warm-up iteration (with no warm-up, from the end of the first
    iteration, since no record says when iteration 0 started) to the end of the last measured
    one; `samples_per_s` divides the global samples of the iterations inside that span by its
    length. Per-iteration traffic, hit rate and phase times average over the measured
    iterations. NaN marks a figure with no data (a hit rate with no uses, a throughput over a
    single iteration).
    """

    mode: str
    trainers: int
    global_batch: int
    warmup: int
    # iterations left out at the end (`bench/e2e.py`: those after the oracle planned its last)
    cooldown: int = 0
    iterations: int  # iterations measured (after warm-up, before the cooldown)
    first_iteration: int  # first measured iteration index
    last_iteration: int
    wall_time_s: float
    samples: int  # global samples inside the timed span
    samples_per_s: float
    iteration_time_s: float
    hit_rate: float
    fetch_rows_per_iter: float
    fetch_bytes_per_iter: float
    write_back_rows_per_iter: float
    write_back_bytes_per_iter: float
    sync_rows_per_iter: float
    sync_bytes_per_iter: float
    join_rows_per_iter: float
    final_loss: float  # samples-weighted mean over the last `loss_window` measured iterations
    loss_window: int
    phase_s: dict[str, float] = field(hash=False)  # mean seconds per iteration and trainer
    eval: EvalPoint | None = None  # the latest evaluation
    finished: bool = False
    checkpoints: int = 0  # complete checkpoints taken during the run
    checkpoint_bytes: float = math.nan  # mean bytes written per checkpoint (PS + dense)
    checkpoint_s: float = math.nan  # mean seconds from a checkpoint's last write to its manifest
    # Mean seconds per iteration and trainer outside forward, backward and the dense step.
    machinery_s: float = math.nan
    # Payload bytes per iteration (all trainers) of each of `BYTE_KINDS`.
    bytes_per_iter: dict[str, float] = field(default_factory=dict, hash=False)
    # Mean CPU seconds per iteration and trainer of each of `COMPUTE_PHASES` (NaN: unknown).
    compute_cpu_s: dict[str, float] = field(default_factory=dict, hash=False)
    # A trainer process's CPU microseconds per sample of its slice, mean over trainers
    # (`cpu_per_sample`): THREAD_GROUPS, then each thread by name; empty where unknown.
    cpu_us_per_sample: dict[str, float] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict (NaN stays a float; `write_report` writes it as null)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["phase_s"] = dict(self.phase_s)
        out["bytes_per_iter"] = dict(self.bytes_per_iter)
        out["compute_cpu_s"] = dict(self.compute_cpu_s)
        out["cpu_us_per_sample"] = dict(self.cpu_us_per_sample)
        out["eval"] = None if self.eval is None else {
            f.name: getattr(self.eval, f.name) for f in fields(self.eval)
        }
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        """Inverse of `to_json`, also for a dict read back from report.json (null → NaN)."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data and f.default is not MISSING:
                continue  # a report written before the field existed
            value = data[f.name] if f.name in data else None
            if f.name == "eval":
                value = None if value is None else EvalPoint(
                    **{k: _float(v) if k in ("auc", "log_loss", "time") else v
                       for k, v in value.items()}
                )
            elif f.name in ("phase_s", "bytes_per_iter", "compute_cpu_s", "cpu_us_per_sample"):
                value = {k: _float(v) for k, v in (value or {}).items()}
            elif f.type == "float":
                value = _float(value)
            kwargs[f.name] = value
        return cls(**kwargs)


def summarise(
    records_by_trainer: Mapping[int, Sequence[Record]],
    *,
    mode: str,
    global_batch: int,
    warmup: int = 0,
    cooldown: int = 0,
    trainers: int | None = None,
    loss_window: int = 10,
) -> RunSummary:
    """Summarise a run from its trainers' records (see `RunSummary` for what each figure
    means). `trainers` is the expected trainer count (default: the highest key + 1).

    Raises `ReportError` naming the trainers with no iteration record, or when `warmup` and
    `cooldown` leave no iteration to measure.
    """
    if warmup < 0 or cooldown < 0 or loss_window < 1:
        raise ReportError(f"warmup and cooldown must be >= 0 and loss_window >= 1, "
                          f"got {warmup}, {cooldown}, {loss_window}")
    s = iteration_series(records_by_trainer, trainers=trainers)
    logged = len(s.iterations)
    n = logged - cooldown  # iterations up to the last measured one
    if warmup >= n:
        raise ReportError(
            f"warmup={warmup} and cooldown={cooldown} leave no iteration to measure: every "
            f"trainer has logged only {logged} common iteration(s)",
            warmup=warmup,
            iterations=logged,
        )
    global_samples = s.global_counter("samples")
    over = np.flatnonzero(global_samples > global_batch)
    if len(over):
        logger.warning(
            "iteration %d: trainers report %d samples, more than the global batch of %d",
            s.iterations[over[0]], global_samples[over[0]], global_batch,
        )
    anchor = max(warmup - 1, 0)  # iteration whose end starts the clock
    timed = n - 1 - anchor
    wall = float(s.end_time[n - 1] - s.end_time[anchor])
    samples = int(global_samples[anchor + 1:n].sum())
    measured = slice(warmup, n)
    n_measured = n - warmup

    def per_iter(name: str) -> float:
        return float(s.counters[name][:, measured].sum() / n_measured)

    uses = s.counters["uses"][:, measured].sum()
    last = slice(n - min(loss_window, n_measured), n)
    return RunSummary(
        mode=mode,
        trainers=len(s.trainers),
        global_batch=global_batch,
        warmup=warmup,
        cooldown=cooldown,
        iterations=n_measured,
        first_iteration=int(s.iterations[warmup]),
        last_iteration=int(s.iterations[n - 1]),
        wall_time_s=wall,
        samples=samples,
        samples_per_s=samples / wall if wall > 0 else math.nan,
        iteration_time_s=wall / timed if timed > 0 else math.nan,
        hit_rate=float(s.counters["hits"][:, measured].sum() / uses) if uses > 0 else math.nan,
        fetch_rows_per_iter=per_iter("fetch_rows"),
        fetch_bytes_per_iter=per_iter("fetch_bytes"),
        write_back_rows_per_iter=per_iter("write_back_rows"),
        write_back_bytes_per_iter=per_iter("write_back_bytes"),
        sync_rows_per_iter=per_iter("sync_rows"),
        sync_bytes_per_iter=per_iter("sync_bytes"),
        join_rows_per_iter=per_iter("join_rows"),
        final_loss=weighted_loss(s.loss[:, last], s.counters["samples"][:, last]),
        loss_window=last.stop - last.start,
        phase_s={p: float(v[:, measured].mean()) for p, v in s.phases.items()},
        machinery_s=float(machinery(s)[:, measured].mean()),
        bytes_per_iter={kind: per_iter(kind) for kind in BYTE_KINDS},
        compute_cpu_s={p: _mean(v[:, measured]) for p, v in s.compute_cpu.items()},
        cpu_us_per_sample=cpu_per_sample(records_by_trainer, int(s.iterations[warmup]), int(s.iterations[n - 1]) + 1),
        eval=s.evals[-1] if s.evals else None,
        finished=s.finished,
        **_checkpoint_figures(records_by_trainer),
    )


#: How `cpu_per_sample` groups a trainer process's CPU time: the training thread inside the
#: model's compute (forward, backward, the dense step), the training thread outside it (the
#: boundary, the sums, copies, records), and every other thread of the process. A trainer's
#: helper processes (`[trainers] ps_client = "process"`) are counted apart, in `HELPERS`.
#: The training thread outside compute is also split by phase (``phase <name>``,
#: `trainer.timing.MACHINERY_PHASES`; ``phase other`` is what no phase timed: records,
#: statistics, reading the directive).
THREAD_GROUPS: tuple[str, ...] = ("training_thread_compute", "training_thread_other", "other_threads")
HELPERS = "helper_processes"


def cpu_per_sample(records_by_trainer: Mapping[int, Sequence[Record]], first: int, stop: int) -> dict[str, float]:
    """CPU microseconds per sample of its own slice, mean over trainers: `THREAD_GROUPS`,
    then each thread by name (``thread <name>``), then the training thread outside compute
    by phase (``phase <name>``, where the records carry it), over the widest span between two of a
    trainer's `ThreadsRecord`s inside iterations [first, stop). Empty where no trainer has
    two such samples (records of an older trainer, a run too short)."""
    per_trainer = []
    for records in records_by_trainer.values():
        samples = [r for r in records if isinstance(r, ThreadsRecord) and first <= r.iteration <= stop]
        if len(samples) < 2:
            continue
        a, b = samples[0], samples[-1]
        inside = [r for r in records if isinstance(r, IterationRecord) and a.iteration <= r.iteration < b.iteration]
        count = sum(r.samples for r in inside)
        if not count or any(not r.compute_cpu for r in inside):
            continue
        used = {name: b.cpu[name] - a.cpu.get(name, 0.0) for name in b.cpu}
        compute = sum(sum(r.compute_cpu.values()) for r in inside)
        training = used.pop(TRAINING, math.nan)
        helpers = {k: used.pop(k) for k in sorted(used) if k.startswith(HELPER_PREFIX)}
        groups = {"training_thread_compute": compute, "training_thread_other": training - compute,
                  "other_threads": sum(used.values())}
        if helpers:
            groups[HELPERS] = sum(helpers.values())
        by_phase = _machinery_by_phase(inside, groups["training_thread_other"])
        per_trainer.append({name: 1e6 * v / count for name, v in
                            {**groups, **{f"thread {k}": v for k, v in sorted(used.items())}, **helpers,
                             **by_phase}.items()})
    if not per_trainer:
        return {}
    names = dict.fromkeys(name for figures in per_trainer for name in figures)
    return {name: float(np.mean([f.get(name, 0.0) for f in per_trainer])) for name in names}


def _machinery_by_phase(inside: Sequence[IterationRecord], outside_compute: float) -> dict[str, float]:
    """CPU seconds of the training thread in each machinery phase over `inside`, and
    ``phase other``, the rest of `outside_compute`; empty if a record lacks them (an older
    trainer's)."""
    if any(not r.machinery_cpu for r in inside):
        return {}
    phases = {f"phase {p}": sum(r.machinery_cpu.get(p, 0.0) for r in inside) for p in MACHINERY_PHASES}
    return {**phases, "phase other": outside_compute - sum(phases.values())}


def machinery(s: IterationSeries) -> np.ndarray:
    """(T, N) seconds of each trainer's iteration spent outside `COMPUTE_PHASES`: bagpipe's
    own cost (the phases add up to the iteration, see `trainer.timing`)."""
    return sum((v for p, v in s.phases.items() if p not in COMPUTE_PHASES), np.zeros(s.loss.shape))


def _checkpoint_figures(records_by_trainer: Mapping[int, Sequence[Record]]) -> dict[str, Any]:
    done = {r.iteration: r for recs in records_by_trainer.values() for r in recs
            if isinstance(r, CheckpointRecord)}  # a resumed run may log one twice: count it once
    if not done:
        return {}
    return {
        "checkpoints": len(done),
        "checkpoint_bytes": float(np.mean([float(r.bytes) for r in done.values()])),
        "checkpoint_s": float(np.mean([r.seconds for r in done.values()])),
    }


def weighted_loss(loss: np.ndarray, samples: np.ndarray) -> float:
    """The samples-weighted mean of the losses that are not NaN (their plain mean where the
    samples add up to 0; NaN if every loss is)."""
    ok = ~np.isnan(loss)
    if not ok.any():
        return math.nan
    weights = samples[ok]
    return float(np.average(loss[ok], weights=weights) if weights.sum() > 0 else loss[ok].mean())


def breakdown_ms(s: IterationSeries, measured: slice) -> dict[str, np.ndarray]:
    """Per phase, the mean ms per iteration of each trainer and, last, of all of them, over
    the iterations `measured` selects."""
    out = {}
    for name, seconds in s.phases.items():
        sec = seconds[:, measured]
        per_trainer = sec.mean(axis=1) if sec.shape[1] else np.zeros(len(s.trainers))
        out[name] = 1e3 * np.append(per_trainer, per_trainer.mean())
    return out


def write_report(
    run_dir: str | os.PathLike[str], summary: RunSummary, extra: Mapping[str, Any]
) -> Path:
    """Write ``run_dir/report.json``: ``{"summary": ..., "extra": extra}`` with NaN as null.

    `extra` carries what the caller wants kept beside the figures (the spec, the command line);
    values that are not JSON types are written as their `str`. Written to a temporary file and
    renamed, so a reader never sees a torn report.
    """
    path = Path(run_dir) / "report.json"
    body = orjson.dumps(
        {"summary": summary.to_json(), "extra": dict(extra)},
        default=str,
        option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
    )
    write_atomically(path, body + b"\n")
    return path


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _mean(values: np.ndarray) -> float:
    """The mean of `values`, and where that is NaN `math.nan` itself: a summary read back
    from JSON (NaN is null there, read as `math.nan`) then still compares equal (NaN != NaN,
    but the same object is equal to itself in a comparison of containers)."""
    mean = float(values.mean())
    return math.nan if math.isnan(mean) else mean


def _join(items: Iterable[object]) -> str:
    return ", ".join(str(i) for i in items)
