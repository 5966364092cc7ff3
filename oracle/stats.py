"""What the planner counts, per iteration and in total (docs/design.md#modes).

Counts are rows; a caller multiplies by the row size (value + optimizer state) for bytes.
A *row use* is a (key, trainer) pair of one iteration: trainer j uses key k at x, however many
samples of its slice carry k. It is a *hit* when j held k before iteration x's fetches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class IterationStats:
    """One iteration x, counted when directive x becomes final."""

    iteration: int
    uses: int  # row uses at x, all trainers
    hits: int  # row uses served by a row resident before x's fetches
    fetched: int  # rows fetched for use at x (admissions; the first static-cache fill at 0)
    prefetched: int  # rows directive x asks the PS for, whatever their target
    joined: int  # rows received through joins at the boundary into x
    written: int  # write-backs of directive x (residency ends and checkpoint flushes)
    sync_now: int  # keys in sync_now(x)
    sync_later: int  # keys in sync_later(x)
    occupancy: tuple[int, ...]  # copies present during x, per trainer


_COUNTERS = ("uses", "hits", "fetched", "prefetched", "joined", "written", "sync_now", "sync_later")


@dataclass(kw_only=True)
class PlannerStats:
    """Running counts over the final iterations: constant memory however long the run (the
    oracle lives as long as it), the last iteration's record kept for a look."""

    num_trainers: int
    iterations: int = 0  # final iterations counted
    first: int | None = None  # the first of them
    last: IterationStats | None = None
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    peak_occupancy: tuple[int, ...] = ()

    def add(self, record: IterationStats) -> None:
        if self.first is None:
            self.first = record.iteration
            self.peak_occupancy = (0,) * self.num_trainers
        self.iterations += 1
        self.last = record
        for name in _COUNTERS:
            self.totals[name] += getattr(record, name)
        self.peak_occupancy = tuple(max(a, b) for a, b in zip(self.peak_occupancy, record.occupancy, strict=True))

    def total(self, name: str) -> int:
        """Sum of one IterationStats counter over every final iteration."""
        return self.totals[name]

    @property
    def hit_rate(self) -> float:
        uses = self.total("uses")
        return self.total("hits") / uses if uses else 0.0
