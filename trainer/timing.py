"""Per-iteration phase timers, so a user sees whether the prefetch is hidden.

The phases of one iteration do not overlap and add up to it: the time from the end of the
previous iteration to the end of this one, with `other` holding what no phase timed
(records, statistics, checkpoint saves). Everything but the model's own work
(`COMPUTE_PHASES`) is the trainer's *machinery*: what bagpipe adds to plain training.

The compute phases are also timed in the calling thread's CPU time (`compute_cpu`): where
other processes share the cores, a phase's wall time can exceed it by the time the thread
waited for one, and the two together tell more work from more waiting.
"""

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
    "dense_optimizer",
    "sync_now",
    "embedding_update",
    "sync_later_wait",
    "write_back_queue",
    "other",
)
#: Forward, backward and the dense optimizer step: what any trainer of the model would do.
COMPUTE_PHASES: tuple[str, ...] = ("forward", "backward", "dense_optimizer")


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration and in total."""

    def __init__(self) -> None:
        self.current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        #: CPU seconds of the calling thread in each compute phase of the last iteration ended.
        self.compute_cpu: dict[str, float] = dict.fromkeys(COMPUTE_PHASES, 0.0)
        self._cpu = dict.fromkeys(COMPUTE_PHASES, 0.0)
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        cpu_start = time.thread_time() if name in self._cpu else None
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.current[name] += elapsed
            self.total[name] += elapsed
            if cpu_start is not None:
                self._cpu[name] += time.thread_time() - cpu_start

    def restart(self) -> None:
        """The next iteration starts now (call when the iteration loop starts)."""
        self._started = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` spent outside a `phase` block (e.g. waiting for a directive)."""
        self.current[name] += seconds
        self.total[name] += seconds

    def end_iteration(self) -> dict[str, float]:
        """The finished iteration's phases, `other` completing them to its wall time (since
        the previous `end_iteration`, or since the timer was made); the next starts at zero.
        Its compute phases' CPU time is `compute_cpu` from now on."""
        now = time.perf_counter()
        done = self.current
        done["other"] = max(0.0, now - self._started - sum(done.values()))
        self.total["other"] += done["other"]
        self.current = dict.fromkeys(PHASES, 0.0)
        self.compute_cpu, self._cpu = self._cpu, dict.fromkeys(COMPUTE_PHASES, 0.0)
        self._started = now
        return done
