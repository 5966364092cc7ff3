"""What the oracle reads from a live stream (docs/design.md#online-training): its batches as
their rows arrive (`LiveWorkload`), and where its plan was cut (`SegmentLog`).

Both logs live in ``<checkpoint.dir>/stream/``: ``parts.jsonl``, the parts in the order they
were taken (`common.data.live.StreamLog`), and ``segments.jsonl``, the plan's cuts. With
them an oracle started again sees the same rows in the same order and, restarted alone,
cuts its plan where the one before did, so the trainers get the very steps they had.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from common.data.live import LiveSource, TakenPart
from common.errors import ConfigError
from common.job import OPEN_END
from common.keys import TableLayout

log = logging.getLogger(__name__)
SEGMENTS = "segments.jsonl"
STREAM_SUMMARY = "summary.json"  # what a stream's run did (the oracle writes it as it ends)

_KeyBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


def stream_folder(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / "stream"


@dataclass(frozen=True, kw_only=True)
class LiveWorkload:
    """The batches of a live stream: batch g is rows [g B, (g + 1) B) of the parts in the
    order they were taken, available once those rows have arrived. The run trains until
    iteration `until` at most (`train.max_iterations` or ``--until``; `OPEN_END` when
    neither is set); a stop ends it sooner (`oracle.service`).

    `start` is the first global iteration planned, as for `oracle.service.Workload`."""

    source: LiveSource
    layout: TableLayout
    batch_size: int
    until: int = OPEN_END
    start: int = 0

    def __post_init__(self) -> None:
        if type(self.until) is not int or not 0 < self.until <= OPEN_END:
            raise ConfigError("--until", f"must be in 1..{OPEN_END}, got {self.until!r}")
        if type(self.start) is not int or not 0 <= self.start <= self.until:
            raise ConfigError("--first-iteration", f"must be in 0..{self.until} (--until), got {self.start!r}")

    @property
    def num_iterations(self) -> int:
        """The most iterations the run may have (its end, unless it is stopped first)."""
        return self.until

    @property
    def poll_s(self) -> float:
        return self.source.spec.poll_s

    def arrived(self, x: int) -> bool:
        """Whether batch x's rows have been taken (without looking for new parts)."""
        return self.source.num_rows >= (x + 1) * self.batch_size

    def refresh(self) -> None:
        """Take the parts completed since (converting each)."""
        self.source.refresh()

    def batch(self, x: int) -> _KeyBatch:
        """(global keys, labels, dense) of batch x, which must have arrived."""
        rows = self.source.rows(x * self.batch_size, (x + 1) * self.batch_size)
        return self.layout.to_keys(rows.sparse), rows.labels, rows.dense

    def first_part_batches(self) -> list[np.ndarray]:
        """The keys of the full batches of the stream's first part (waiting for it): what a
        static cache pins from, the same whenever the oracle starts."""
        while not self.source.parts:
            self.refresh()
            if not self.source.parts:
                log.info("static-cache: waiting for the stream's first part to choose the rows it pins")
                time.sleep(self.poll_s)
        rows = self.source.parts[0].rows
        return [self.batch(g)[0] for g in range(rows // self.batch_size)]


class SegmentLog:
    """Where the plan of each start was cut: a line ``{"first": F}`` where a plan from F
    begins (a fresh run, a resume, a regroup), then a line ``{"end": E}`` per cut, each
    appended and fsynced before the directives it ends are sent."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / SEGMENTS

    def ends_of(self, first: int) -> list[int]:
        """The cuts logged since the last plan from `first` began ([] if it is not the last)."""
        ends: list[int] | None = None
        if self.path.is_file():
            for n, line in enumerate(self.path.read_bytes().splitlines(), start=1):
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    log.warning("%s line %d is torn: ignored (the cut it held was never sent)", self.path, n)
                    continue
                if "first" in entry:
                    ends = [] if entry["first"] == first else None
                elif ends is not None:
                    ends.append(int(entry["end"]))
        return ends or []

    def begin(self, first: int) -> None:
        self._append({"first": first})

    def end(self, iteration: int) -> None:
        self._append({"end": iteration})

    def _append(self, entry: dict[str, int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            fh.write(orjson.dumps(entry) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())


def freshness(parts: list[TakenPart], links: list[tuple[int, float]], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Seconds from each row's arrival to the first export that trained on it, as (seconds,
    rows) pairs: `links` are the exports' (checkpoint, time.time() once written), in order;
    export c holds the rows of iterations up to c, rows [0, (c + 1) B). Rows no export holds
    yet are left out."""
    seconds, weights = [], []
    start = 0
    covered = [((c + 1) * batch_size, t) for c, t in links]
    for part in parts:
        a, end = start, start + part.rows
        for rows_through, exported_s in covered:
            if rows_through <= a:
                continue
            b = min(end, rows_through)
            seconds.append(exported_s - part.taken_s)
            weights.append(b - a)
            a = b
            if a >= end:
                break
        start = end
    return np.array(seconds, np.float64), np.array(weights, np.int64)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-th percentile of `values`, each counted `weights` times (NaN for none)."""
    if values.size == 0 or weights.sum() == 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q / 100 * cumulative[-1])])
