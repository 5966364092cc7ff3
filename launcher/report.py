"""Run reports: summarise a run from its trainers' records, show it as text, JSON, plots, progress.

The records are `trainer.records`'s (read there, from ``RUN_DIR/trainer-<j>.jsonl``).

Layers, from pure to I/O: `iteration_series` and `summarise` turn records into numbers;
`format_summary` and `compare_modes` turn numbers into text; `write_report`, `plot_run`,
`plot_rss`, `plot_modes` and `ProgressBar` touch files or the terminal. matplotlib is imported
only by the plotting functions, so a launcher that never plots does not pay for it. Sizes are decimal: 1 MB = 10^6 bytes.
"""

from __future__ import annotations

import io
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import orjson
from tqdm import tqdm

from common.errors import BagpipeError
from common.files import write_atomically
from common.spec import MODES
from trainer.records import (
    BYTE_KINDS,
    COUNTERS,
    CheckpointRecord,
    EvalRecord,
    FinalRecord,
    IterationRecord,
    Record,
)
from trainer.timing import COMPUTE_PHASES, PHASES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from launcher.memory import RssCurve

logger = logging.getLogger(__name__)

_OPTIONAL_COUNTERS = tuple(k for k in BYTE_KINDS if k not in COUNTERS)

_MB = 1e6


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

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict (NaN stays a float; `write_report` writes it as null)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["phase_s"] = dict(self.phase_s)
        out["bytes_per_iter"] = dict(self.bytes_per_iter)
        out["compute_cpu_s"] = dict(self.compute_cpu_s)
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
            elif f.name in ("phase_s", "bytes_per_iter", "compute_cpu_s"):
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
        final_loss=_weighted_loss(s.loss[:, last], s.counters["samples"][:, last]),
        loss_window=last.stop - last.start,
        phase_s={p: float(v[:, measured].mean()) for p, v in s.phases.items()},
        machinery_s=float(machinery(s)[:, measured].mean()),
        bytes_per_iter={kind: per_iter(kind) for kind in BYTE_KINDS},
        compute_cpu_s={p: _mean(v[:, measured]) for p, v in s.compute_cpu.items()},
        eval=s.evals[-1] if s.evals else None,
        finished=s.finished,
        **_checkpoint_figures(records_by_trainer),
    )


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


def _weighted_loss(loss: np.ndarray, samples: np.ndarray) -> float:
    ok = ~np.isnan(loss)
    if not ok.any():
        return math.nan
    weights = samples[ok]
    return float(np.average(loss[ok], weights=weights) if weights.sum() > 0 else loss[ok].mean())


# --------------------------------------------------------------------------- text


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


def _num(value: float, fmt: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, fmt)


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f} %"


def format_summary(summary: RunSummary) -> str:
    """A plain-text table of `summary` (at most 100 columns), ending without a newline."""
    s = summary
    ev = s.eval
    status = "finished" if s.finished else "in progress"
    warm = f", first {s.warmup} excluded as warm-up" if s.warmup else ""
    warm += f", last {s.cooldown} excluded" if s.cooldown else ""
    rows: list[tuple[str, str, str]] = [
        ("throughput", _num(s.samples_per_s, ",.1f"), "samples/s"),
        ("iteration time", _num(1e3 * s.iteration_time_s, ",.2f"), "ms"),
        ("wall time", _num(s.wall_time_s, ",.2f"), f"s ({s.samples:,} samples timed)"),
        ("hit rate", _pct(s.hit_rate).removesuffix(" %"), "%"),
        ("fetched", _num(s.fetch_bytes_per_iter / _MB, ",.3f"),
         f"MB/iter ({s.fetch_rows_per_iter:,.1f} rows)"),
        ("written back", _num(s.write_back_bytes_per_iter / _MB, ",.3f"),
         f"MB/iter ({s.write_back_rows_per_iter:,.1f} rows)"),
        ("synchronised", _num(s.sync_bytes_per_iter / _MB, ",.3f"),
         f"MB/iter ({s.sync_rows_per_iter:,.1f} rows, {s.join_rows_per_iter:,.1f} joins)"),
        ("machinery", _num(1e3 * s.machinery_s, ",.2f"),
         "ms/iter (all but forward, backward and the dense optimizer step)"),
        ("compute CPU", _num(1e3 * sum(s.compute_cpu_s.values(), 0.0) if s.compute_cpu_s else math.nan, ",.2f"),
         "ms/iter of CPU in forward, backward and the dense step"),
        ("final loss", _num(s.final_loss, ".4f"), f"(mean of last {s.loss_window} iterations)"),
    ]
    if s.checkpoints:
        rows.append(("checkpoints", f"{s.checkpoints:,}",
                     f"taken: {_num(s.checkpoint_bytes / _MB, ',.2f')} MB and "
                     f"{_num(s.checkpoint_s, '.2f')} s each (PS snapshots + dense model)"))
    if ev is not None:
        rows += [
            ("eval AUC", _num(ev.auc, ".4f"), f"(iteration {ev.iteration}, {ev.count:,} samples)"),
            ("eval log loss", _num(ev.log_loss, ".4f"), ""),
        ]
    lines = [
        f"Run summary: mode {s.mode}, {s.trainers} trainer(s), global batch {s.global_batch:,}, "
        f"{status}",
        f"  iterations {s.first_iteration}..{s.last_iteration} ({s.iterations} measured{warm})",
    ]
    lines += [f"  {name:<16}{value:>14}  {unit}".rstrip() for name, value, unit in rows]
    lines += _format_phases(s.phase_s)
    return "\n".join(lines)


def _format_phases(phase_s: Mapping[str, float]) -> list[str]:
    total = sum(phase_s.values())
    lines = ["Phase breakdown (mean per iteration and trainer)",
             f"  {'phase':<16}{'ms':>14}  {'share':>7}"]
    for name, sec in phase_s.items():
        share = sec / total if total > 0 else 0.0
        bar = "#" * round(40 * share)
        lines.append(f"  {name:<16}{1e3 * sec:>14,.3f}  {100 * share:>6.1f}%  {bar}".rstrip())
    lines.append(f"  {'total':<16}{1e3 * total:>14,.3f}  (the phases add up to the iteration)")
    return lines


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 and not math.isnan(num) else math.nan


def _mode_order(names: Iterable[str]) -> list[str]:
    names = list(names)
    return [m for m in MODES if m in names] + sorted(n for n in names if n not in MODES)


def compare_modes(summaries: Mapping[str, RunSummary]) -> str:
    """One row per mode (bagpipe, no-cache, static-cache, local, then any others by name):
    samples/s, iteration time, hit rate, fetched and synchronised MB per iteration, and the
    throughput relative to `local` and to `no-cache` when those modes are present."""
    ratio_to = [m for m in ("local", "no-cache") if m in summaries]
    head = (f"{'mode':<14}{'samples/s':>12}{'iter ms':>10}{'hit rate':>10}"
            f"{'fetch MB/it':>13}{'sync MB/it':>12}")
    head += "".join(f"{'vs ' + m:>13}" for m in ratio_to)
    lines = [head, "-" * len(head)]
    for name in _mode_order(summaries):
        s = summaries[name]
        line = (f"{name:<14}{_num(s.samples_per_s, ',.1f'):>12}"
                f"{_num(1e3 * s.iteration_time_s, ',.2f'):>10}{_pct(s.hit_rate):>10}"
                f"{_num(s.fetch_bytes_per_iter / _MB, ',.3f'):>13}"
                f"{_num(s.sync_bytes_per_iter / _MB, ',.3f'):>12}")
        for m in ratio_to:
            ratio = _ratio(s.samples_per_s, summaries[m].samples_per_s)
            line += f"{_num(ratio, '.2f') + ('' if math.isnan(ratio) else 'x'):>13}"
        lines.append(line)
    return "\n".join(lines)


def compare_bytes(summaries: Mapping[str, RunSummary]) -> str:
    """One row per mode: payload MB per iteration and trainer of each kind of traffic (PS
    fetches and write-backs, embedding sync now and later, joins, the dense gradients DDP
    all-reduces), and their total."""
    kinds = [k.removesuffix("_bytes").replace("_", " ") for k in BYTE_KINDS]
    head = f"{'mode':<14}" + "".join(f"{k:>12}" for k in kinds) + f"{'total':>10}"
    lines = [head, "-" * len(head)]
    for name in _mode_order(summaries):
        s = summaries[name]
        per = [s.bytes_per_iter.get(k, math.nan) / s.trainers / _MB for k in BYTE_KINDS]
        lines.append(f"{name:<14}" + "".join(f"{_num(v, ',.3f'):>12}" for v in per)
                     + f"{_num(sum(per), ',.3f'):>10}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- files


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


def _new_figure(rows: int, width: float = 9.0, height: float = 3.6) -> tuple[Figure, Any]:
    # A bare Figure on an Agg canvas: no pyplot, no global backend switch, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False)[:, 0]


def _zero_based(ax: Any, values: Sequence[float] | np.ndarray) -> None:
    """Start the y axis at 0 with headroom above the data (a flat line would otherwise sit on
    the top spine), with thousands separators on the ticks."""
    from matplotlib.ticker import StrMethodFormatter

    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    top = float(finite.max()) if finite.size else 0.0
    ax.set_ylim(0, 1.15 * top if top > 0 else 1.0)
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def _save(fig: Figure, path: Path) -> Path:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    write_atomically(path, png.getvalue())
    return path


def _windowed_ratio(num: np.ndarray, den: np.ndarray, window: int) -> np.ndarray:
    """Ratio of sums over the last `window` points at each point (not a mean of ratios)."""
    cn = np.concatenate([[0.0], np.cumsum(num)])
    cd = np.concatenate([[0.0], np.cumsum(den)])
    idx = np.arange(1, len(num) + 1)
    lo = np.maximum(idx - window, 0)
    d = cd[idx] - cd[lo]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, (cn[idx] - cn[lo]) / np.where(d > 0, d, 1.0), np.nan)


def _smoothing_window(n: int) -> int:
    return max(1, min(50, n // 20))


def plot_run(
    run_dir: str | os.PathLike[str], records_by_trainer: Mapping[int, Sequence[Record]], *, warmup: int = 0
) -> list[Path]:
    """Draw ``throughput.png`` (samples/s and hit rate per iteration, smoothed),
    ``breakdown.png`` (mean phase times per trainer, stacked, over the iterations after the
    first `warmup`, as the summary's) and ``loss.png`` (training loss per iteration with eval
    AUC points) into `run_dir`; returns their paths.

    Raises `ReportError` as `iteration_series` does.
    """
    s = iteration_series(records_by_trainer)
    out = Path(run_dir)
    measured = slice(min(warmup, max(len(s.iterations) - 1, 0)), None)
    return [_plot_throughput(s, out / "throughput.png"), _plot_breakdown(s, measured, out / "breakdown.png"),
            _plot_loss(s, out / "loss.png")]


def _plot_throughput(s: IterationSeries, path: Path) -> Path:
    fig, (ax_t, ax_h) = _new_figure(2)
    w = _smoothing_window(len(s.iterations))
    # Iteration k's duration is end_time[k] - end_time[k-1]: the first iteration has none.
    dt = np.diff(s.end_time)
    thr = _windowed_ratio(s.global_counter("samples")[1:], dt, w)
    ax_t.plot(s.iterations[1:], thr, color="tab:blue")
    ax_t.set_title(f"Throughput (all trainers, {w}-iteration window)")
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel("samples/s")
    _zero_based(ax_t, thr)
    hit = _windowed_ratio(s.global_counter("hits"), s.global_counter("uses"), w)
    ax_h.plot(s.iterations, 100 * hit, color="tab:green")
    ax_h.set_title(f"Cache hit rate (rows resident before fetch / rows used, {w}-iteration window)")
    ax_h.set_xlabel("iteration")
    ax_h.set_ylabel("hit rate (%)")
    ax_h.set_ylim(0, 105)
    for ax in (ax_t, ax_h):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def breakdown_ms(s: IterationSeries, measured: slice) -> dict[str, np.ndarray]:
    """Per phase, the mean ms per iteration of each trainer and, last, of all of them, over
    the iterations `measured` selects."""
    out = {}
    for name, seconds in s.phases.items():
        sec = seconds[:, measured]
        per_trainer = sec.mean(axis=1) if sec.shape[1] else np.zeros(len(s.trainers))
        out[name] = 1e3 * np.append(per_trainer, per_trainer.mean())
    return out


def _plot_breakdown(s: IterationSeries, measured: slice, path: Path) -> Path:
    from matplotlib import colormaps  # 20 distinct colours: more phases than tab10 has

    fig, (ax,) = _new_figure(1, height=max(3.0, 1.0 + 0.45 * (len(s.trainers) + 1)))
    labels = [f"trainer {j}" for j in s.trainers] + ["mean"]
    left = np.zeros(len(labels))
    palette = colormaps["tab20"].colors
    for i, (name, ms) in enumerate(breakdown_ms(s, measured).items()):
        ax.barh(labels, ms, left=left, label=name, color=palette[i % len(palette)])
        left += ms
    ax.invert_yaxis()
    spent = machinery(s)[:, measured]
    mean_ms = 1e3 * float(spent.mean()) if spent.size else math.nan
    first = s.iterations[measured][0] if spent.size else 0
    ax.set_title(f"Where an iteration's time goes (mean from iteration {first}; machinery {mean_ms:,.2f} ms)")
    ax.set_xlabel("time per iteration (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="phase")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _plot_loss(s: IterationSeries, path: Path) -> Path:
    fig, (ax,) = _new_figure(1, height=4.0)
    loss = np.array([_weighted_loss(s.loss[:, k:k + 1], s.counters["samples"][:, k:k + 1])
                     for k in range(len(s.iterations))])
    w = _smoothing_window(len(loss))
    ax.plot(s.iterations, loss, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    if w > 1:
        smooth = np.convolve(np.nan_to_num(loss), np.ones(w) / w, mode="valid")
        ax.plot(s.iterations[w - 1:], smooth, color="tab:blue", label=f"loss ({w}-iteration mean)")
    ax.set_title("Training loss" + (" and eval AUC" if s.evals else ""))
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (mean over global batch)")
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    points = [e for e in s.evals if not math.isnan(e.auc)]
    if points:
        ax_auc = ax.twinx()
        ax_auc.plot([e.iteration for e in points], [e.auc for e in points], "o-",
                    color="tab:red", label="eval AUC")
        ax_auc.set_ylabel("eval AUC", color="tab:red")
        h2, n2 = ax_auc.get_legend_handles_labels()
        handles, names = handles + h2, names + n2
    ax.legend(handles, names, loc="best", fontsize="small")
    return _save(fig, path)


def plot_rss(curves: Mapping[str, RssCurve], warm_from: int, path: str | os.PathLike[str]) -> Path:
    """``memory.png``: each role's RSS over the iterations of training (`launcher.memory`),
    with the end of the warm-up marked."""
    fig, (ax,) = _new_figure(1, height=4.0)
    shown: list[float] = []
    for role, c in curves.items():
        ax.plot(c.done[c.training], c.rss_mb[c.training], label=role, lw=1.2)
        shown.extend(c.rss_mb[c.training])
    ax.axvline(warm_from, color="grey", ls="--", lw=0.8, label="warm-up end")
    ax.set_title("Resident memory (RSS) of every role, sampled about once a second")
    ax.set_xlabel("iterations done by every trainer")
    ax.set_ylabel("RSS (MB)")
    _zero_based(ax, shown)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small", ncols=2)
    return _save(fig, Path(path))


def plot_modes(summaries: Mapping[str, RunSummary], path: str | os.PathLike[str]) -> Path:
    """Bar charts comparing modes: samples/s (labelled with the ratio to `no-cache` when it is
    present) and MB moved per iteration (fetched, written back, synchronised)."""
    order = _mode_order(summaries)
    fig, (ax_t, ax_b) = _new_figure(2, width=8.0, height=3.4)
    x = np.arange(len(order))
    thr = [summaries[m].samples_per_s for m in order]
    bars = ax_t.bar(x, thr, color=[f"C{i % 10}" for i in range(len(order))])
    base = summaries["no-cache"].samples_per_s if "no-cache" in summaries else math.nan
    if base > 0:
        ax_t.bar_label(bars, labels=[_num(_ratio(v, base), ".2f") + "x" for v in thr], padding=2)
    ax_t.set_title("End-to-end throughput by mode"
                   + (" (labels: ratio to no-cache)" if base > 0 else ""))
    ax_t.set_ylabel("samples/s")
    _zero_based(ax_t, thr)
    width = 0.27
    for i, (label, attr) in enumerate((("fetched", "fetch_bytes_per_iter"),
                                       ("written back", "write_back_bytes_per_iter"),
                                       ("synchronised", "sync_bytes_per_iter"))):
        ax_b.bar(x + (i - 1) * width, [getattr(summaries[m], attr) / _MB for m in order],
                 width, label=label)
    ax_b.set_title("Embedding traffic per iteration (all trainers)")
    ax_b.set_ylabel("MB/iteration")
    ax_b.margins(y=0.25)
    ax_b.legend(fontsize="small", ncols=3, loc="upper center")
    for ax in (ax_t, ax_b):
        ax.set_xticks(x, order)
        ax.set_xlabel("mode")
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, Path(path))


# --------------------------------------------------------------------------- progress


def remaining_seconds(recent_ends: Sequence[float], remaining: int) -> float:
    """Seconds to run `remaining` more iterations at the pace of the recent ones.

    `recent_ends` are the end times of one trainer's latest iterations, ascending. Their
    span covers len - 1 iterations and none of the start-up before the first of them ended
    (starting processes, compiling the planner, the first fetches), which an average since
    the start would spread over every iteration left: early in a short run that inflates
    the estimate many times over. NaN with fewer than two ends to measure a pace from.
    """
    if len(recent_ends) < 2 or recent_ends[-1] <= recent_ends[0]:
        return math.nan
    return remaining * (recent_ends[-1] - recent_ends[0]) / (len(recent_ends) - 1)


class ProgressBar:
    """A tqdm bar on stderr for a running job: iterations done by every trainer, samples/s,
    loss and hit rate over the last `window` iterations of each trainer, and the ETA at the
    pace of those iterations (`remaining_seconds`; tqdm's own counts the start-up in).

    When the stream is not a terminal (`enabled=None`, the default) the bar stays silent and
    a line is logged at INFO each time another 10 % of `total_iterations` is done (every 30 s
    when the total is unknown), so CI logs still show progress. Pass `trainers` so that a
    trainer that has not logged anything yet holds the count at 0.
    """

    def __init__(
        self,
        total_iterations: int | None,
        description: str,
        *,
        trainers: int | None = None,
        file: TextIO | None = None,
        enabled: bool | None = None,
        window: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bar = tqdm(
            total=total_iterations,
            desc=description,
            unit="it",
            file=file if file is not None else sys.stderr,
            disable=None if enabled is None else not enabled,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
        )
        self._total = total_iterations
        self._description = description
        self._done: dict[int, set[int]] = {j: set() for j in range(trainers or 0)}
        self._recent: dict[int, deque[IterationRecord]] = {}
        self._window = max(window, 2)
        self._clock = clock
        self._last_log = clock()
        self._logged_tenths = 0

    @property
    def done(self) -> int:
        """Iterations every trainer has finished (the minimum over trainers)."""
        return min((len(d) for d in self._done.values()), default=0)

    def update(self, records_by_trainer_new: Mapping[int, Sequence[Record]]) -> None:
        """Take each trainer's records written since the previous call."""
        for j, records in records_by_trainer_new.items():
            for rec in records:
                if isinstance(rec, IterationRecord):
                    self._done.setdefault(j, set()).add(rec.iteration)
                    self._recent.setdefault(j, deque(maxlen=self._window)).append(rec)
        done = self.done
        self._bar.set_postfix_str(self._stats_text(), refresh=False)
        self._bar.update(done - self._bar.n)
        if self._bar.disable:
            self._maybe_log(done)

    def _stats(self) -> tuple[float, float, float]:
        rate, hits, uses, loss_sum, loss_n = 0.0, 0, 0, 0.0, 0
        for recent in self._recent.values():
            if len(recent) >= 2 and recent[-1].time > recent[0].time:
                timed = list(recent)[1:]
                rate += sum(r.samples for r in timed) / (recent[-1].time - recent[0].time)
            for r in recent:
                hits, uses = hits + r.hits, uses + r.uses
                if not math.isnan(r.loss):
                    loss_sum, loss_n = loss_sum + r.loss * r.samples, loss_n + r.samples
        return (rate if rate > 0 else math.nan, loss_sum / loss_n if loss_n else math.nan,
                hits / uses if uses else math.nan)

    def _eta(self) -> float:
        """Seconds left for the trainer furthest from the end; NaN while any pace is unknown."""
        if not self._total or not self._done:
            return math.nan
        return max(
            remaining_seconds([r.time for r in self._recent.get(j, ())], self._total - len(done))
            for j, done in self._done.items()
        )

    def _stats_text(self) -> str:
        rate, loss, hit = self._stats()
        text = f"{_num(rate, ',.0f')} samples/s, loss {_num(loss, '.4f')}, hit {_pct(hit)}"
        eta = self._eta()
        if self.done < (self._total or 0) and math.isfinite(eta):
            text += f", ETA {tqdm.format_interval(eta)}"
        return text

    def _maybe_log(self, done: int) -> None:
        now = self._clock()
        if self._total:
            tenths = min(10, 10 * done // self._total)
            if tenths <= self._logged_tenths:
                return
            self._logged_tenths = tenths
        elif now - self._last_log < 30.0:
            return
        self._log(done, now)

    def _log(self, done: int, now: float) -> None:
        self._last_log = now
        total = f"/{self._total}" if self._total else ""
        pct = f" ({100 * done / self._total:.0f}%)" if self._total else ""
        logger.info("%s: %d%s iterations%s, %s", self._description, done, total, pct, self._stats_text())

    def close(self) -> None:
        """Finish the bar; when it was silent, log the final count once more if not yet at 100 %."""
        if self._bar.disable and self._logged_tenths < 10:
            self._log(self.done, self._clock())
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
