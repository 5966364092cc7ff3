"""Log lines for events a peer can provoke at will (bad connections, limits hit).

Such events arrive as fast as an attacker or a broken client can make them, so each kind
gets a `RateLimitedLog`: at most `burst` lines per `interval_s`; the lines held back are
counted and the next line let through says how many ("(120 more suppressed)"). Lines carry
no traceback: the message names the event, a stack would only repeat the transport's code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most `burst` lines per `interval_s` through `logger`; the rest counted."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._interval_s = interval_s
        self._clock = clock
        self._window_start = -interval_s
        self._sent = 0
        self.suppressed = 0  # held back since the last line let through

    def log(self, level: int, msg: str, *args: object) -> None:
        if not self._logger.isEnabledFor(level):
            return
        now = self._clock()
        if now - self._window_start >= self._interval_s:
            self._window_start, self._sent = now, 0
        if self._sent >= self._burst:
            self.suppressed += 1
            return
        self._sent += 1
        if self.suppressed:
            msg, args = f"{msg} (%d more suppressed)", (*args, self.suppressed)
            self.suppressed = 0
        self._logger.log(level, msg, *args)

    def warning(self, msg: str, *args: object) -> None:
        self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args: object) -> None:
        self.log(logging.INFO, msg, *args)


class RateLimitedLogs:
    """A `RateLimitedLog` per kind of event, made on first use, so that a flood of one kind
    (say, rapid resets) cannot use up the lines that report another (the connection cap)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._by_kind: dict[str, RateLimitedLog] = {}

    def __getitem__(self, kind: str) -> RateLimitedLog:
        if kind not in self._by_kind:
            self._by_kind[kind] = RateLimitedLog(self._logger)
        return self._by_kind[kind]
