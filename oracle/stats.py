"""What the planner counts, per iteration and in total (DESIGN §8).

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


@dataclass(kw_only=True)
class PlannerStats:
    """Running counts; `iterations` grows by one record per final directive."""

    num_trainers: int
    iterations: list[IterationStats] = field(default_factory=list)

    def add(self, record: IterationStats) -> None:
        self.iterations.append(record)

    def total(self, name: str) -> int:
        """Sum of one IterationStats counter over every final iteration."""
        return sum(getattr(r, name) for r in self.iterations)

    @property
    def hit_rate(self) -> float:
        uses = self.total("uses")
        return self.total("hits") / uses if uses else 0.0

    @property
    def peak_occupancy(self) -> tuple[int, ...]:
        peak = [0] * self.num_trainers
        for r in self.iterations:
            peak = [max(a, b) for a, b in zip(peak, r.occupancy, strict=True)]
        return tuple(peak)
