"""Skew statistics of embedding accesses: what a cache planner can expect from a data set.

Per table and overall: accesses, distinct rows, the share of accesses covered by the most
used 0.1% / 1% / 10% of the *distinct rows seen*, rows seen once, and the reuse distance:
the number of iterations (at a given batch size) between consecutive uses of a row, uses
within one iteration counted once. Memory: two int32 counters per table row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FRACTIONS = (0.001, 0.01, 0.1)
PERCENTILES = (10, 50, 90, 99)


@dataclass(frozen=True, kw_only=True)
class TableSkew:
    name: str
    size: int
    accesses: int
    distinct: int
    top_share: dict[str, float]  # "0.1%" → share of accesses
    seen_once: int
    reuses: int  # uses that follow an earlier use in an earlier iteration
    reuse_percentiles: dict[str, float]  # "p50" → iterations; empty if nothing reused
    curve: list[tuple[float, float]]  # (fraction of distinct rows, share of accesses)


@dataclass(frozen=True, kw_only=True)
class SkewReport:
    rows: int
    batch_size: int
    tables: list[TableSkew]
    overall: TableSkew
    reuse_histogram: dict[str, int]  # overall distances in power-of-two bins ("1", "2-3", ...)

    def to_json(self) -> dict:
        return asdict(self)


class _TableCounter:
    def __init__(self, size: int) -> None:
        self.counts = np.zeros(size, dtype=np.int32)
        self.last_use = np.full(size, -1, dtype=np.int32)
        self.distances = np.zeros(1, dtype=np.int64)  # histogram by exact distance

    def add(self, rows: np.ndarray, iters: np.ndarray) -> None:
        if len(rows) > 4 * len(self.counts):
            self.counts += np.bincount(rows, minlength=len(self.counts)).astype(np.int32)
        else:
            u, c = np.unique(rows, return_counts=True)
            self.counts[u] += c.astype(np.int32)
        order = np.lexsort((iters, rows))
        r, it = rows[order], iters[order]
        first_of_row = np.r_[True, r[1:] != r[:-1]]
        prev = np.where(first_of_row, self.last_use[r], np.r_[-1, it[:-1]])
        dist = (it - prev)[(prev >= 0) & (it != prev)]
        self.distances = _add_hist(self.distances, np.bincount(dist))
        last_of_row = np.r_[r[1:] != r[:-1], True]
        self.last_use[r[last_of_row]] = it[last_of_row]


def _add_hist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(b) > len(a):
        a, b = b.astype(np.int64), a
    a = a.copy()
    a[: len(b)] += b
    return a


def skew_stats(
    chunks: Iterable[np.ndarray], table_sizes: Sequence[int], batch_size: int,
    names: Sequence[str] | None = None,
) -> SkewReport:  # fmt: skip
    """Statistics of consecutive ``[n, F]`` row-id chunks; row i is in iteration i // batch_size."""
    counters = [_TableCounter(n) for n in table_sizes]
    names = list(names) if names else [f"t{t}" for t in range(len(table_sizes))]
    done = 0
    for chunk in chunks:
        iters = ((done + np.arange(len(chunk))) // batch_size).astype(np.int32)
        for t, counter in enumerate(counters):
            counter.add(np.asarray(chunk[:, t], dtype=np.int64), iters)
        done += len(chunk)
    tables = [_summary(names[t], c.counts, c.distances) for t, c in enumerate(counters)]
    all_counts = np.concatenate([c.counts for c in counters]) if counters else np.zeros(0, np.int32)
    hist = np.zeros(1, dtype=np.int64)
    for c in counters:
        hist = _add_hist(hist, c.distances)
    overall = _summary("overall", all_counts, hist)
    return SkewReport(rows=done, batch_size=batch_size, tables=tables, overall=overall,
                      reuse_histogram=_log2_bins(hist))  # fmt: skip


def _summary(name: str, counts: np.ndarray, distances: np.ndarray) -> TableSkew:
    seen = np.sort(counts[counts > 0])[::-1].astype(np.int64)
    total = int(seen.sum())
    cum = np.cumsum(seen)
    top = {}
    for f in FRACTIONS:
        k = max(1, math.ceil(f * len(seen)))
        top[f"{f:.1%}".replace(".0%", "%")] = float(cum[k - 1] / total) if total else 0.0
    xs = np.unique(np.ceil(np.geomspace(1, max(len(seen), 1), 120)).astype(np.int64))
    curve = [(float(k / len(seen)), float(cum[k - 1] / total)) for k in xs] if total else []
    return TableSkew(
        name=name, size=len(counts), accesses=total, distinct=len(seen), top_share=top,
        seen_once=int((seen == 1).sum()), reuses=int(distances.sum()),
        reuse_percentiles=_percentiles(distances), curve=curve,
    )  # fmt: skip


def _percentiles(hist: np.ndarray) -> dict[str, float]:
    total = hist.sum()
    if total == 0:
        return {}
    cum = np.cumsum(hist)
    out = {f"p{p}": float(np.searchsorted(cum, p / 100 * total)) for p in PERCENTILES}
    out["mean"] = float((np.arange(len(hist)) * hist).sum() / total)
    return out


def _log2_bins(hist: np.ndarray) -> dict[str, int]:
    out: dict[str, int] = {}
    lo = 1
    while lo < len(hist):
        hi = 2 * lo - 1
        out[str(lo) if lo == hi else f"{lo}-{hi}"] = int(hist[lo : hi + 1].sum())
        lo *= 2
    return out


def format_table(report: SkewReport) -> str:
    """The report as a fixed-width text table, one line per table plus the overall line."""
    rows = [*report.tables, report.overall]
    w = max(14, *(len(s.name) + 2 for s in rows))  # the longest name (Avazu's are long) and a gap
    head = (f"{'table':<{w}}{'rows':>11}{'accesses':>11}{'distinct':>10}{'top0.1%':>9}{'top1%':>8}"
            f"{'top10%':>8}{'once':>9}{'reuse p50':>10}{'p90':>7}")  # fmt: skip
    lines = [f"rows {report.rows:,}, batch size {report.batch_size}", head, "-" * len(head)]
    for s in rows:
        p = s.reuse_percentiles
        lines.append(
            f"{s.name:<{w}}{s.size:>11}{s.accesses:>11}{s.distinct:>10}{s.top_share['0.1%']:>9.3f}"
            f"{s.top_share['1%']:>8.3f}{s.top_share['10%']:>8.3f}{s.seen_once:>9}"
            f"{p.get('p50', float('nan')):>10.0f}{p.get('p90', float('nan')):>7.0f}"
        )  # fmt: skip
    return "\n".join(lines)


def write_json(report: SkewReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=1))


def plot_coverage(report: SkewReport, path: Path) -> None:
    """PNG: share of accesses covered versus fraction of distinct rows (log x), per table."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in report.tables:
        if s.curve:
            ax.plot(*zip(*s.curve, strict=True), color="0.7", linewidth=0.8)
    if report.overall.curve:
        ax.plot(*zip(*report.overall.curve, strict=True), color="C3", linewidth=2, label="overall")
    ax.set_xscale("log")
    ax.set_xlabel("fraction of distinct rows seen (most used first)")
    ax.set_ylabel("share of accesses covered")
    ax.set_title(f"Coverage, {report.rows:,} rows (grey: one line per table)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
