"""The encoded steps between the planning thread and the trainers' streams.

The planner runs in its own thread (it is CPU work) and `put`s each final iteration; stream
handlers on the event loop `get` them. The buffer keeps the planner at most `max_ahead`
iterations ahead of the slowest trainer (so a trainer that stops reading stops the planner
too), and keeps already sent steps from `retain_from` on, never one a trainer may still
need, so a trainer that reconnects can resume from any iteration it has not received.

What a trainer may still need is everything from its *position* on: the first step it has
not shown it received. Steps written to a stream prove nothing (a reader may take a window
of them into its socket and go away), so a trainer shows it with its own requests: an
acknowledgement (`acknowledge`, ``POST /v1/stream/ack``) once it has received a step, and
the start of each stream it opens (a trainer that resumes asks for the first step it did
not receive). Neither counts past the steps streams have actually been handed for that
trainer. So a stray reader of a trainer's stream that does not acknowledge moves nothing,
whatever it reads; one that starts past the position waits for the planner like any other.
The exception is an oracle restarted alone: the trainers come back wherever they were, so
each one's first stream sets its position to where it starts.

Iterations are global: a run resumed from a checkpoint starts at `first` (docs/design.md#resuming-every-role), and
steps before it were never held here (asking for them answers 409); the run ends at `end`,
known from the start, so a stream from there on is answered at once, whatever the planner
is doing.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from common.errors import BagpipeError, Conflict


@dataclass(frozen=True, kw_only=True)
class Depths:
    """How full the buffer is, at one moment (for the oracle's metrics)."""

    produced: int  # the next iteration the planner will put
    positions: tuple[int, ...]  # each trainer's position: the first step it has not acknowledged
    held: int  # steps kept: not yet sent to every trainer, or kept for a resume


class StepBuffer:
    def __init__(
        self,
        num_trainers: int,
        max_ahead: int,
        loop: asyncio.AbstractEventLoop,
        *,
        first: int = 0,
        end: int,
        restarted_alone: bool = False,
    ) -> None:
        self.num_trainers = num_trainers
        self.max_ahead = max_ahead
        self.end = end
        self._loop = loop
        self._steps: dict[int, list[bytes]] = {}
        self._first_kept = first
        self._produced = first  # the next iteration to put
        self._position = [first] * num_trainers  # the first step each has not acknowledged
        self._handed = [first] * num_trainers  # past the last step handed to a stream of each
        self._trust_first = [restarted_alone] * num_trainers  # its next stream sets its position
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

    def set_end(self, end: int) -> None:
        """The run ends at `end` (a stream stopped): streams past it end at once."""
        with self._lock:
            self.end = end
        self._notify()

    def caught_up(self) -> bool:
        """Whether every trainer has received every step put so far: at a live stream's
        edge, the moment to cut the plan (`oracle.live`)."""
        with self._lock:
            return self._slowest() >= self._produced

    def wait_caught_up(self, timeout: float) -> bool:
        """`caught_up`, waiting up to `timeout` seconds for it (or for a failure)."""
        with self._lock:
            self._lock.wait_for(lambda: self._slowest() >= self._produced or self._error is not None, timeout)
            return self._error is None and self._slowest() >= self._produced

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            self._lock.notify_all()
        self._notify()

    # -- stream side (event loop) --------------------------------------------------------

    async def get(self, trainer: int, iteration: int) -> bytes | None:
        """Trainer's message for `iteration`, waiting for the planner; None from the end on."""
        while True:
            with self._lock:
                self._check_streamable(iteration)
                if iteration >= self.end:
                    return None
                if iteration in self._steps:
                    return self._steps[iteration][trainer]
                self._changed.clear()
            await self._changed.wait()

    def open_stream(self, trainer: int, start: int) -> None:
        """A stream of `trainer` from `start` on: its start acknowledges the steps before it
        (see the module docstring)."""
        with self._lock:
            self._check_streamable(start)
            if self._trust_first[trainer]:
                self._trust_first[trainer] = False
                self._handed[trainer] = max(self._handed[trainer], start)
                self._position[trainer] = start
                self._lock.notify_all()
            else:
                self._advance(trainer, start)

    def handing(self, trainer: int, iteration: int) -> None:
        """A stream of `trainer` is handing `iteration` to the transport: the trainer may
        acknowledge it from now on (not before: its acknowledgement may come first)."""
        with self._lock:
            self._handed[trainer] = max(self._handed[trainer], iteration + 1)

    def acknowledge(self, trainer: int, received: int) -> int:
        """`trainer` has received every step before `received`; its position after."""
        with self._lock:
            self._advance(trainer, received)
            return self._position[trainer]

    def _advance(self, trainer: int, received: int) -> None:
        # caller holds self._lock
        position = max(self._position[trainer], min(received, self._handed[trainer]))
        if position != self._position[trainer]:
            self._position[trainer] = position
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
            positions = tuple(self._position)
            return Depths(produced=self._produced, positions=positions, held=len(self._steps))

    def _slowest(self) -> int:
        # caller holds self._lock
        return min(self._position)

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
