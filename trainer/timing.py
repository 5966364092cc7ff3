"""Per-iteration phase timers, so a user sees whether the prefetch is hidden.

The phases of one iteration do not overlap and add up to it: the time from the end of the
previous iteration to the end of this one, with `other` holding what no phase timed
(records, statistics, checkpoint saves). Everything but the model's own work
(`COMPUTE_PHASES`) is the trainer's *machinery*: what bagpipe adds to plain training.

Every phase block is also timed in the calling thread's CPU time: `compute_cpu` for the
compute phases, `machinery_cpu` for the others. Where other processes share the cores, a
phase's wall time can exceed it by the time the thread waited for one (or for a collective),
and the two together tell more work from more waiting; the machinery's CPU by phase says
what of the training thread's own work outside the model to cut first.
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
#: The phases timed by a `phase` block outside the model's compute (`other` is what is left).
MACHINERY_PHASES: tuple[str, ...] = tuple(p for p in PHASES if p not in COMPUTE_PHASES and p != "other")
_TIMED_PHASES = (*COMPUTE_PHASES, *MACHINERY_PHASES)


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration and in total."""

    def __init__(self) -> None:
        self.current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        #: CPU seconds of the calling thread in each timed phase of the last iteration ended.
        self.phase_cpu: dict[str, float] = dict.fromkeys(_TIMED_PHASES, 0.0)
        self._cpu = dict.fromkeys(_TIMED_PHASES, 0.0)
        self._started = time.perf_counter()

    @property
    def compute_cpu(self) -> dict[str, float]:
        """`phase_cpu` of `COMPUTE_PHASES`."""
        return {p: self.phase_cpu[p] for p in COMPUTE_PHASES}

    @property
    def machinery_cpu(self) -> dict[str, float]:
        """`phase_cpu` of `MACHINERY_PHASES`."""
        return {p: self.phase_cpu[p] for p in MACHINERY_PHASES}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.current[name] += elapsed
            self.total[name] += elapsed
            if name in self._cpu:
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
        Its phases' CPU time is `phase_cpu` from now on."""
        now = time.perf_counter()
        done = self.current
        done["other"] = max(0.0, now - self._started - sum(done.values()))
        self.total["other"] += done["other"]
        self.current = dict.fromkeys(PHASES, 0.0)
        self.phase_cpu, self._cpu = self._cpu, dict.fromkeys(_TIMED_PHASES, 0.0)
        self._started = now
        return done
