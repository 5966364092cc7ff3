"""How long a client keeps trying a peer that went away (a PS shard, the oracle).

A peer restarted alone (docs/design.md#a-ps-shard-restarted-alone, `launch.py --rejoin`) is back within seconds: a client
retries at least `retries` times *and* for at least `window_s`, with delays doubling from
`first_delay_s` up to MAX_BACKOFF_S, so it notices the new process soon after it listens.
"""

from __future__ import annotations

import asyncio
import time

MAX_BACKOFF_S = 1.0  # a peer restarting is retried at least this often


class RetryBudget:
    """The retries of one outage; `reset` when the peer answered again."""

    def __init__(self, retries: int, window_s: float, first_delay_s: float) -> None:
        self.retries, self.window_s, self.first_delay_s = retries, window_s, first_delay_s
        self.reset()

    def reset(self) -> None:
        self.failures = 0
        self.delay = self.first_delay_s
        self._first_failure: float | None = None

    @property
    def waited_s(self) -> float:
        return 0.0 if self._first_failure is None else time.monotonic() - self._first_failure

    def allows_retry(self) -> bool:
        """Call after each failure: whether another attempt is due (then `await wait()`)."""
        if self._first_failure is None:
            self._first_failure = time.monotonic()
        return self.failures < self.retries or self.waited_s < self.window_s

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, MAX_BACKOFF_S)
        self.failures += 1
