"""A running job's progress: a bar on a terminal, a log line every 10 % otherwise.

`ProgressBar.update` takes each trainer's records as the launcher tails them
(`trainer.records.RunTail`); `remaining_seconds` is its ETA.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from tqdm import tqdm

from launcher.text import format_number, format_percent
from trainer.records import IterationRecord, Record, TermRecord

logger = logging.getLogger(__name__)


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
        self._term = 0  # an elastic run's term, from its trainers' records
        self._terms: dict[int, int] = {}  # the term each trainer's records are at

    def _begin_term(self, term: TermRecord) -> None:
        """An elastic run's next term: its trainers, every iteration before its first done."""
        self._term = term.term
        before = range(term.first_iteration)
        self._done = {j: set(before) for j in range(term.trainers)}
        self._recent = {j: recent for j, recent in self._recent.items() if j < term.trainers}

    @property
    def done(self) -> int:
        """Iterations every trainer has finished (the minimum over trainers)."""
        return min((len(d) for d in self._done.values()), default=0)

    def update(self, records_by_trainer_new: Mapping[int, Sequence[Record]]) -> None:
        """Take each trainer's records written since the previous call."""
        for j, records in records_by_trainer_new.items():
            for rec in records:
                if isinstance(rec, TermRecord):
                    self._terms[j] = rec.term
                    if rec.term > self._term:
                        self._begin_term(rec)
                elif isinstance(rec, IterationRecord) and self._terms.get(j, 0) == self._term:
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
        text = (f"{format_number(rate, ',.0f')} samples/s, loss {format_number(loss, '.4f')}, "
                f"hit {format_percent(hit)}")
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
