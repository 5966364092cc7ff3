"""The encoded steps between the planning thread and the trainers' streams.

The planner runs in its own thread (it is CPU work) and `put`s each final iteration; stream
handlers on the event loop `get` them. The buffer keeps the planner at most `max_ahead`
iterations ahead of the slowest trainer (so HTTP/2 flow control on a slow trainer's stream
stops the planner too), and keeps already sent steps from `retain_from` on, so a trainer
that reconnects can resume from any iteration it has not finished.

Iterations are global: a run resumed from a checkpoint starts at `first` (DESIGN §9), and
steps before it were never held here (asking for them answers 409).
"""

from __future__ import annotations

import asyncio
import threading

from common.errors import BagpipeError, Conflict


class StepBuffer:
    def __init__(
        self, num_trainers: int, max_ahead: int, loop: asyncio.AbstractEventLoop, *, first: int = 0
    ) -> None:
        self.num_trainers = num_trainers
        self.max_ahead = max_ahead
        self.total: int | None = None
        self._loop = loop
        self._steps: dict[int, list[bytes]] = {}
        self._first_kept = first
        self._produced = first  # the next iteration to put
        self._sent = [first] * num_trainers  # next iteration each trainer has not yet been sent
        self._error: BaseException | None = None
        self._lock = threading.Condition()  # guards everything above; the planner waits on it
        self._changed = asyncio.Event()

    # -- planner side (thread) -----------------------------------------------------------

    def put(self, iteration: int, messages: list[bytes]) -> None:
        """Add iteration's per-trainer messages; blocks while too far ahead of the trainers."""
        with self._lock:
            self._lock.wait_for(lambda: self._produced - min(self._sent) < self.max_ahead or self._error)
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

    def start_stream(self, trainer: int, start: int) -> None:
        """`trainer` asks for steps from `start` on: it has the earlier ones (an oracle
        restarted alone replans from an earlier iteration), so they do not hold the planner."""
        with self._lock:
            self._sent[trainer] = max(self._sent[trainer], start)
            self._lock.notify_all()

    def mark_sent(self, trainer: int, iteration: int) -> None:
        """The stream of `trainer` handed `iteration` to the transport."""
        with self._lock:
            self._sent[trainer] = max(self._sent[trainer], iteration + 1)
            self._lock.notify_all()

    def retain_from(self, iteration: int) -> None:
        """Forget steps before `iteration` (a trainer can no longer resume before it)."""
        with self._lock:
            for old in range(self._first_kept, min(iteration, min(self._sent))):
                self._steps.pop(old, None)
                self._first_kept = old + 1

    def check_resumable(self, iteration: int) -> None:
        """Raise what a stream from `iteration` would meet at once: the planner's failure, or
        Conflict (409) if the iteration is no longer held."""
        with self._lock:
            self._check_streamable(iteration)

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
