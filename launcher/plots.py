"""A run's plots: matplotlib PNGs drawn from its records, its RSS curves or several summaries.

`plot_run` draws ``throughput.png``, ``breakdown.png`` and ``loss.png``, `plot_rss`
``memory.png``, `plot_terms` an elastic run's ``trainers.png`` and `plot_modes` a comparison
of modes. Each figure is a bare `Figure` on an
Agg canvas (no pyplot, no global backend, no display), written atomically. matplotlib is
imported only inside these functions, so a launcher that never plots does not pay for it.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.files import write_atomically
from launcher.summary import (
    IterationSeries, RunSummary, breakdown_ms, iteration_series, machinery, weighted_loss,
)
from launcher.text import MB, format_number, mode_order, ratio
from trainer.records import Record, TermRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from launcher.memory import RssCurve


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
    loss = np.array([weighted_loss(s.loss[:, k:k + 1], s.counters["samples"][:, k:k + 1])
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


def plot_terms(terms: Sequence[TermRecord], total: int, path: str | os.PathLike[str]) -> Path:
    """An elastic run's trainer count over the iterations, each regroup marked where its
    term began (the iterations an ending term trained past that point were trained again)."""
    fig, (ax,) = _new_figure(1, height=3.0)
    starts = [t.first_iteration for t in terms] + [total]
    counts = [t.trainers for t in terms]
    ax.step(starts, counts + counts[-1:], where="post", color="tab:blue")
    for term in terms[1:]:
        ax.axvline(term.first_iteration, color="tab:gray", linestyle=":", linewidth=1)
        ax.annotate(f"term {term.term}", (term.first_iteration, term.trainers), textcoords="offset points",
                    xytext=(3, 4), fontsize=8)
    ax.set_xlim(0, max(total, 1))
    ax.set_ylim(0, max(counts) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("iteration")
    ax.set_ylabel("trainers")
    ax.set_title(f"Trainers over the iterations ({len(terms) - 1} regroup(s))")
    return _save(fig, Path(path))


def plot_modes(summaries: Mapping[str, RunSummary], path: str | os.PathLike[str]) -> Path:
    """Bar charts comparing modes: samples/s (labelled with the ratio to `no-cache` when it is
    present) and MB moved per iteration (fetched, written back, synchronised)."""
    order = mode_order(summaries)
    fig, (ax_t, ax_b) = _new_figure(2, width=8.0, height=3.4)
    x = np.arange(len(order))
    thr = [summaries[m].samples_per_s for m in order]
    bars = ax_t.bar(x, thr, color=[f"C{i % 10}" for i in range(len(order))])
    base = summaries["no-cache"].samples_per_s if "no-cache" in summaries else math.nan
    if base > 0:
        ax_t.bar_label(bars, labels=[format_number(ratio(v, base), ".2f") + "x" for v in thr], padding=2)
    ax_t.set_title("End-to-end throughput by mode"
                   + (" (labels: ratio to no-cache)" if base > 0 else ""))
    ax_t.set_ylabel("samples/s")
    _zero_based(ax_t, thr)
    width = 0.27
    for i, (label, attr) in enumerate((("fetched", "fetch_bytes_per_iter"),
                                       ("written back", "write_back_bytes_per_iter"),
                                       ("synchronised", "sync_bytes_per_iter"))):
        ax_b.bar(x + (i - 1) * width, [getattr(summaries[m], attr) / MB for m in order],
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
