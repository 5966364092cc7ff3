"""Per-iteration phase timers, so a user sees whether the prefetch is hidden."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

#: Phases in the order they happen within an iteration; the run report lists them so.
PHASES: tuple[str, ...] = (
    "wait_directive",
    "boundary",
    "wait_prefetch",
    "forward",
    "backward",
    "sync_now",
    "sync_later_wait",
    "optimizer",
    "write_back_queue",
)


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration and in total."""

    def __init__(self) -> None:
        self.current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.current[name] += elapsed
            self.total[name] += elapsed

    def end_iteration(self) -> dict[str, float]:
        """The finished iteration's phases; starts the next one at zero."""
        done = self.current
        self.current = dict.fromkeys(PHASES, 0.0)
        return done
