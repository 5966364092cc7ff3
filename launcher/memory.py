"""Every role's resident memory and CPU time over a run: sampled by the launcher, summarised
per role.

A local run's launcher (`launcher.cluster.run_cluster`) reads each live role's ``VmRSS`` from
``/proc/<pid>/status`` and its CPU time (user + system, ``/proc/<pid>/stat``) about once a
second and appends one line per sample to ``RUN_DIR/rss.jsonl``: ``{"time": unix seconds,
"rss_mb": {role: MB}, "cpu_s": {role: seconds}}`` (files from before CPU time was sampled
have no ``cpu_s``). Nothing in the roles changes, and the file grows by about 0.7 MB an hour.

The CPU time tells where a machine's cores go: on a small machine the PS shards and the
oracle take theirs from the trainers, and a trainer's CPU time against its iteration time
says how much of the iteration it waited.

`rss_curves` puts the samples on the iteration axis with the trainers' records (the
iterations every trainer had finished when the sample was taken) and `summarise_rss` gives,
per role, the RSS once the warm-up is over, at the end of training, its peak, and its growth
per 1,000 iterations after the warm-up: the slope of a least-squares line through the
samples, so that one allocation spike or a short plateau does not decide it, given only when
the samples span 1,000 iterations or more (a shorter run says nothing about the long term),
and its CPU time per iteration after the warm-up. Sizes are decimal: 1 MB = 10^6 bytes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

log = logging.getLogger(__name__)

RSS_FILE = "rss.jsonl"
SAMPLE_INTERVAL_S = 1.0
MIN_GROWTH_SPAN = 1000  # iterations after the warm-up that a growth figure needs
_MB = 1e6


def read_rss_mb(pid: int) -> float | None:
    """Process `pid`'s resident set in MB, or None when it is gone (or a zombie: no VmRSS)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024 / _MB  # the kernel counts in kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_cpu_s(pid: int) -> float | None:
    """Process `pid`'s CPU time so far (user + system, its threads included) in seconds, or
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # the name in (...) may hold spaces
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class RssRecorder:
    """Appends the RSS and CPU time of the roles it is shown to ``rss.jsonl``, at most once
    per `interval_s`; `sample` is cheap to call more often (the launcher polls every 0.2 s)."""

    def __init__(
        self, path: str | os.PathLike[str], *, interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.time, read: Callable[[int], float | None] = read_rss_mb,
        read_cpu: Callable[[int], float | None] = read_cpu_s,
    ) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._clock = clock
        self._read = read
        self._read_cpu = read_cpu
        self._last = -math.inf

    def sample(self, roles: Iterable[tuple[str, int]]) -> None:
        """Record the RSS and CPU time of each (name, pid) still running, if `interval_s`
        has passed."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        roles = list(roles)
        rss = {name: mb for name, pid in roles if (mb := self._read(pid)) is not None}
        if not rss:
            return
        cpu = {
            name: s for name, pid in roles if name in rss and (s := self._read_cpu(pid)) is not None
        }
        line = orjson.dumps({"time": now, "rss_mb": {k: round(v, 3) for k, v in rss.items()},
                             "cpu_s": {k: round(v, 3) for k, v in cpu.items()}}) + b"\n"
        try:
            with open(self.path, "ab") as f:
                f.write(line)
        except OSError as exc:  # a full disk must not stop the run for a diagnostic
            log.warning("could not record RSS in %s: %s", self.path, exc)


@dataclass(frozen=True, kw_only=True)
class RssSample:
    time: float  # unix seconds
    rss_mb: Mapping[str, float]  # role -> MB
    cpu_s: Mapping[str, float] = field(default_factory=dict)  # role -> CPU seconds so far


def read_rss(run_dir: str | os.PathLike[str]) -> list[RssSample]:
    """The samples of ``run_dir/rss.jsonl`` in order; none when the file does not exist. A
    line cut short (the launcher was killed while writing it) is left out."""
    path = Path(run_dir) / RSS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            record = orjson.loads(line)
            out.append(RssSample(time=float(record["time"]), rss_mb=dict(record["rss_mb"]),
                                 cpu_s=dict(record.get("cpu_s", {}))))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class RssCurve:
    """One role's samples: `done[i]` is the number of iterations every trainer had finished
    (the global index of the next one) when `rss_mb[i]` was read; `training[i]` whether
    training was still going on (not yet the final evaluation and saves)."""

    role: str
    time: np.ndarray  # (n,) unix seconds
    done: np.ndarray  # (n,) int64
    rss_mb: np.ndarray  # (n,) float64
    training: np.ndarray  # (n,) bool
    cpu_s: np.ndarray  # (n,) float64: CPU seconds so far, NaN where the sample has none

    def points(self, limit: int = 1000) -> list[tuple[int, float]]:
        """(done, MB) pairs for a report, every k-th one so that at most `limit` remain (the
        last one always kept)."""
        step = max(1, math.ceil(len(self.done) / limit))
        keep = list(range(0, len(self.done), step))
        if keep and keep[-1] != len(self.done) - 1:
            keep.append(len(self.done) - 1)
        return [(int(self.done[i]), round(float(self.rss_mb[i]), 3)) for i in keep]


def rss_curves(samples: Sequence[RssSample], iterations: np.ndarray, end_time: np.ndarray) -> dict[str, RssCurve]:
    """Per role, its samples on the iteration axis. `iterations` and `end_time` are
    `launcher.summary.IterationSeries`'s: the common iterations, ascending, and when the
    slowest trainer finished each."""
    if not len(iterations):
        raise ValueError("no iteration finished by every trainer: nothing to place the samples on")
    ends = np.maximum.accumulate(np.asarray(end_time, dtype=np.float64))
    next_of = np.append(iterations[0], np.asarray(iterations, dtype=np.int64) + 1)
    roles = sorted({role for s in samples for role in s.rss_mb}, key=_role_order)
    curves = {}
    for role in roles:
        mine = [s for s in samples if role in s.rss_mb]
        t = np.array([s.time for s in mine], dtype=np.float64)
        curves[role] = RssCurve(
            role=role, time=t, done=next_of[np.searchsorted(ends, t, side="right")],
            rss_mb=np.array([s.rss_mb[role] for s in mine], dtype=np.float64), training=t <= ends[-1],
            cpu_s=np.array([s.cpu_s.get(role, math.nan) for s in mine], dtype=np.float64),
        )
    return curves


@dataclass(frozen=True, kw_only=True)
class RssFigures:
    """One role's memory over a run (MB); NaN where no sample says (see the module docstring)."""

    role: str
    warm_mb: float  # the first sample once every trainer had finished the warm-up
    end_mb: float  # the last sample while training
    peak_mb: float  # the highest sample of the run, start-up and final saves included
    growth_mb_per_1k: float  # least-squares slope over training after the warm-up, or NaN
    samples: int  # samples the slope was fitted to
    cpu_ms_per_iter: float = math.nan  # CPU time per iteration over the same samples, or NaN

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "warm_mb": self.warm_mb, "end_mb": self.end_mb, "peak_mb": self.peak_mb,
                "growth_mb_per_1k": self.growth_mb_per_1k, "samples": self.samples,
                "cpu_ms_per_iter": self.cpu_ms_per_iter}


def summarise_rss(
    curves: Mapping[str, RssCurve], warm_from: int, *, cpu_until: int | None = None,
    min_span: int = MIN_GROWTH_SPAN,
) -> dict[str, RssFigures]:
    """Per role, `RssFigures` with the warm-up ending once `warm_from` iterations (a global
    index) were done by every trainer; the growth is NaN unless the samples after it span
    `min_span` iterations, the CPU time per iteration unless two of them have one and span
    an iteration. The CPU time counts until `cpu_until` iterations were done (default: the
    end of training)."""
    out = {}
    for role, c in curves.items():
        fit = c.training & (c.done >= warm_from)
        cpu = fit & (c.done <= cpu_until) if cpu_until is not None else fit
        x, y = c.done[fit].astype(np.float64), c.rss_mb[fit]
        spans = x.size >= 2 and x[-1] - x[0] >= max(min_span, 1)
        slope = float(np.polyfit(x, y, 1)[0]) if spans else math.nan
        out[role] = RssFigures(
            role=role, warm_mb=float(y[0]) if y.size else math.nan, end_mb=float(y[-1]) if y.size else math.nan,
            peak_mb=float(c.rss_mb.max()) if c.rss_mb.size else math.nan,
            growth_mb_per_1k=1000 * slope, samples=int(fit.sum()),
            cpu_ms_per_iter=_cpu_ms_per_iter(c.done[cpu], c.cpu_s[cpu]),
        )
    return out


def _cpu_ms_per_iter(done: np.ndarray, cpu_s: np.ndarray) -> float:
    """CPU milliseconds per iteration between the first and the last sample that has a CPU
    time (the counter only grows, so two samples say as much as a fit)."""
    have = ~np.isnan(cpu_s)
    done, cpu_s = done[have], cpu_s[have]
    if done.size < 2 or done[-1] == done[0]:
        return math.nan
    return float(1e3 * (cpu_s[-1] - cpu_s[0]) / (done[-1] - done[0]))


def format_rss(figures: Mapping[str, RssFigures], warm_from: int, title: str = "Memory") -> str:
    """A table of `figures`: one line per role."""
    head = (f"  {'role':<12}{'warm-up end':>13}{'end':>10}{'peak':>10}{'growth per 1k it':>18}"
            f"{'CPU ms/it':>11}")
    lines = [f"{title} (RSS in MB, CPU time per iteration; after iteration {warm_from:,}, "
             "until training ended)", head]
    for f in figures.values():
        growth = "n/a" if math.isnan(f.growth_mb_per_1k) else f"{f.growth_mb_per_1k:+,.2f}"
        n = format_figure
        lines.append(f"  {f.role:<12}{n(f.warm_mb):>13}{n(f.end_mb):>10}{n(f.peak_mb):>10}{growth:>18}"
                     f"{n(f.cpu_ms_per_iter):>11}")
    return "\n".join(lines)


def format_figure(value: float) -> str:
    """A table's MB or ms figure: one decimal, n/a for NaN."""
    return "n/a" if math.isnan(value) else f"{value:,.1f}"


def _role_order(role: str) -> tuple[int, int, str]:
    """oracle, ps-0, ps-1, ..., trainer-0, ...: the order the launcher starts them in."""
    kind, _, index = role.partition("-")
    rank = {"oracle": 0, "ps": 1, "trainer": 2}.get(kind, 3)
    return rank, int(index) if index.isdigit() else -1, role
