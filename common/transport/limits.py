"""Connection hygiene both servers enforce, and the sliding-window counter behind the
HTTP/2 rapid-reset guard (sans-IO: the caller passes the time)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """Per-server limits; the defaults are the production ones (`[cluster]` in the spec).

    * `idle_timeout_s`: a connection with no request in progress for this long is closed
      (HTTP/2 with GOAWAY first), so held-open sockets cannot pile up.
    * `max_connections`: connections served at once; one more is closed as soon as it is
      accepted, with a log line, so the process keeps file descriptors for its peers.
    * `max_concurrent_streams`: HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, enforced.
    * `max_resets` per `reset_window_s`: HTTP/2 streams a peer resets (or that are
      refused) on one connection; past it the connection gets GOAWAY ENHANCE_YOUR_CALM
      (CVE-2023-44487). A client whose requests time out resets a handful a second; a
      rapid-reset attacker thousands, so it is cut off within milliseconds.
    """

    idle_timeout_s: float = 300.0
    max_connections: int = 1024
    max_concurrent_streams: int = 256
    max_resets: int = 200
    reset_window_s: float = 10.0


class EventWindow:
    """Counts events in a sliding window of `window_s` seconds; `hit` says when more than
    `limit` fell inside it. Memory is `limit + 1` timestamps, whatever the event rate."""

    def __init__(self, limit: int, window_s: float) -> None:
        self._times: deque[float] = deque(maxlen=limit + 1)
        self._window_s = window_s

    def hit(self, now: float) -> bool:
        """Record one event at `now`; True if it is the (limit + 1)-th within the window."""
        self._times.append(now)
        full = len(self._times) == self._times.maxlen
        return full and now - self._times[0] <= self._window_s
