"""The encoded steps between the planning thread and the trainers' streams.

The planner runs in its own thread (it is CPU work) and `put`s each final iteration; stream
handlers on the event loop `get` them. The buffer keeps the planner at most `max_ahead`
iterations ahead of the slowest trainer (so HTTP/2 flow control on a slow trainer's stream
stops the planner too), and keeps already sent steps from `retain_from` on, never one a
trainer may still need, so a trainer that reconnects can resume from any iteration it has
not finished.

What a trainer may still need is its *position*: the minimum, over its open streams that
count, of the next step each has not sent, and while none is open, where the last one
stopped. A stream counts only if it starts at or before its trainer's position, as a
trainer that resumes does (it asks for the first step it did not receive); one that starts
past it (a stray reader, say) neither moves the position nor holds the planner, and gets
its steps once the planner is there. So a second reader of a trainer cannot make the
buffer drop steps an open stream of that trainer still needs. The exception is an oracle
restarted alone: the trainers come back wherever they were, so each one's first stream
counts from its start.

Iterations are global: a run resumed from a checkpoint starts at `first` (DESIGN §9), and
steps before it were never held here (asking for them answers 409).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass

from common.errors import BagpipeError, Conflict


@dataclass(frozen=True, kw_only=True)
class Depths:
    """How full the buffer is, at one moment (for the oracle's metrics)."""

    produced: int  # the next iteration the planner will put
    positions: tuple[int, ...]  # each trainer's position (module docstring)
    held: int  # steps kept: not yet sent to every trainer, or kept for a resume


class StepBuffer:
    def __init__(
        self,
        num_trainers: int,
        max_ahead: int,
        loop: asyncio.AbstractEventLoop,
        *,
        first: int = 0,
        restarted_alone: bool = False,
    ) -> None:
        self.num_trainers = num_trainers
        self.max_ahead = max_ahead
        self.total: int | None = None
        self._loop = loop
        self._steps: dict[int, list[bytes]] = {}
        self._first_kept = first
        self._produced = first  # the next iteration to put
        self._open: list[dict[int, int]] = [{} for _ in range(num_trainers)]  # counted stream -> position
        self._idle_at = [first] * num_trainers  # a trainer's position while none of its streams is open
        self._trust_first = [restarted_alone] * num_trainers  # its next stream counts from any start
        self._stream_ids = itertools.count()
        self._error: BaseException | None = None
        self._lock = threading.Condition()  # guards everything above; the planner waits on it
        self._changed = asyncio.Event()

    # -- planner side (thread) -----------------------------------------------------------

    def put(self, iteration: int, messages: list[bytes]) -> None:
        """Add iteration's per-trainer messages; blocks while too far ahead of the trainers."""
        with self._lock:
            self._lock.wait_for(lambda: self._produced - self._slowest() < self.max_ahead or self._error)
            if iteration != self._produced:
                raise RuntimeError(f"steps must be put in order: got {iteration}, expected {self._produced}")
            self._steps[iteration] = messages
            self._produced += 1
        self._notify()

    def finish(self, total: int) -> None:
        """No step after `total` - 1 (the run's last global iteration) will come."""
        with self._lock:
            self.total = total
        self._notify()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            self._lock.notify_all()
        self._notify()

    # -- stream side (event loop) --------------------------------------------------------

    async def get(self, trainer: int, iteration: int) -> bytes | None:
        """Trainer's message for `iteration`, waiting for the planner; None after the end."""
        while True:
            with self._lock:
                self._check_streamable(iteration)
                if iteration in self._steps:
                    return self._steps[iteration][trainer]
                if self.total is not None and iteration >= self.total:
                    return None
                self._changed.clear()
            await self._changed.wait()

    def open_stream(self, trainer: int, start: int) -> int | None:
        """A stream of `trainer` from `start` on: its id if it counts toward the trainer's
        position (see the module docstring), else None."""
        with self._lock:
            self._check_streamable(start)
            if not (self._trust_first[trainer] or start <= self._position(trainer)):
                return None
            self._trust_first[trainer] = False
            stream = next(self._stream_ids)
            self._open[trainer][stream] = start
            self._lock.notify_all()
        return stream

    def mark_sent(self, trainer: int, stream: int | None, iteration: int) -> None:
        """Stream `stream` of `trainer` (from `open_stream`) handed `iteration` to the transport."""
        if stream is None:
            return
        with self._lock:
            self._open[trainer][stream] = iteration + 1
            self._lock.notify_all()

    def close_stream(self, trainer: int, stream: int | None) -> None:
        """Stream `stream` of `trainer` ended or broke."""
        if stream is None:
            return
        with self._lock:
            position = self._open[trainer].pop(stream)
            if not self._open[trainer]:
                self._idle_at[trainer] = position
            self._lock.notify_all()

    def retain_from(self, iteration: int) -> None:
        """Forget steps before `iteration`, but none a trainer may still need."""
        with self._lock:
            for old in range(self._first_kept, min(iteration, self._slowest())):
                self._steps.pop(old, None)
                self._first_kept = old + 1

    def check_resumable(self, iteration: int) -> None:
        """Raise what a stream from `iteration` would meet at once: the planner's failure, or
        Conflict (409) if the iteration is no longer held."""
        with self._lock:
            self._check_streamable(iteration)

    def depths(self) -> Depths:
        with self._lock:
            positions = tuple(self._position(j) for j in range(self.num_trainers))
            return Depths(produced=self._produced, positions=positions, held=len(self._steps))

    def _position(self, trainer: int) -> int:
        # caller holds self._lock
        streams = self._open[trainer]
        return min(streams.values()) if streams else self._idle_at[trainer]

    def _slowest(self) -> int:
        # caller holds self._lock
        return min(self._position(j) for j in range(self.num_trainers))

    def _check_streamable(self, iteration: int) -> None:
        # caller holds self._lock
        if self._error is not None:
            raise _as_bagpipe_error(self._error)
        if iteration < self._first_kept:
            raise Conflict(
                f"iteration {iteration} is no longer held (oldest kept: {self._first_kept})",
                oldest=self._first_kept,
            )

    def _notify(self) -> None:
        self._loop.call_soon_threadsafe(self._changed.set)


def _as_bagpipe_error(error: BaseException) -> BagpipeError:
    if isinstance(error, BagpipeError):
        return error
    return BagpipeError(f"the oracle's planner failed: {error!r}")
