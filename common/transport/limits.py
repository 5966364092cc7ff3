"""Connection hygiene both servers enforce, the sliding-window counter behind the HTTP/2
rapid-reset guard, the token bucket behind the unauthenticated-request budget and the
bookkeeping of connections that have not shown the token yet (sans-IO: the caller passes
the time and closes what it is told to)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar


#: How long a connection that is closing with a request body still arriving keeps reading
#: (and dropping) it, so that the peer reads the answer before the close: closing with its
#: bytes unread makes the kernel reset the connection, which can destroy the answer in
#: flight. Both servers: the HTTP/2 GOAWAY, HTTP/1.1's answers given before the body.
LINGER_S = 1.0


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """Per-server limits; the defaults are the production ones (`[cluster]` in the spec).

    * `idle_timeout_s`: a connection with no request in progress for this long is closed
      (HTTP/2 with GOAWAY first), so held-open sockets cannot pile up.
    * `max_connections`: connections served at once; one more is closed as soon as it is
      accepted, with a log line, so the process keeps file descriptors for its peers. It is
      also the listen backlog: a burst of connections (a flood of them among it) waits in
      the kernel to be accepted and judged, rather than a newcomer's being dropped there and
      retried by TCP seconds later.
    * `max_concurrent_streams`: HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, enforced.
    * `max_resets` per `reset_window_s`: HTTP/2 streams a peer resets (or that are
      refused) on one connection; past it the connection gets GOAWAY ENHANCE_YOUR_CALM
      (CVE-2023-44487). A client whose requests time out resets a handful a second; a
      rapid-reset attacker thousands, so it is cut off within milliseconds.
    * `unauthenticated_rate`: requests a server answers without the bearer token (public
      routes such as health and metrics, and refusals), per second on average over all its
      connections, `unauthenticated_burst` at once. Past the budget, an HTTP/2 connection
      that sent one is answered but not read again until the rate allows; on HTTP/1.1,
      which answers a connection's requests in order, the answer itself waits. A flood of
      cheap requests takes a bounded share of the CPU the trainers' requests need.
      Probes and scrapes ask a few times a second.
    * `auth_timeout_s`: a connection that has not sent a request with the bearer token this
      long after it was accepted is closed, whatever it sends meanwhile (public requests,
      a byte now and then). A trainer or shard shows it in its first request; a probe or a
      scrape reconnects.
    * `max_unauthenticated_connections`: connections held at once that have not shown the
      token yet; one more, or one more past `max_connections`, closes the oldest of them
      (`Newcomers`). Connections without the token can thus never hold a slot a role with
      it needs: a newcomer is refused only when every slot is taken by peers that have shown
      the token.
    """

    idle_timeout_s: float = 300.0
    max_connections: int = 1024
    max_concurrent_streams: int = 256
    max_resets: int = 200
    reset_window_s: float = 10.0
    unauthenticated_rate: float = 200.0
    unauthenticated_burst: int = 200
    auth_timeout_s: float = 10.0
    max_unauthenticated_connections: int = 256


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


class TokenBucket:
    """`rate` events a second on average, `burst` at once. `take` always counts the event and
    says how long its sender should wait so that the events so far keep to the rate."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> float:
        """Spend one token at `now`; the seconds until the budget is no longer overdrawn
        (0.0: within it)."""
        if self._at is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0.0 else -self._tokens / self._rate


C = TypeVar("C")


class Newcomers(Generic[C]):
    """A server's connections that have not shown the token yet, oldest first, and the
    slot policy of `ConnectionLimits`: a connection without the token may be closed to make
    room for a newer one, a connection with it never is.

    `C` is whatever the server uses to name a connection (hashable).
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self._max_total = limits.max_connections
        self._max = limits.max_unauthenticated_connections
        self._waiting: dict[C, None] = {}  # insertion order: oldest first

    def arrive(self, conn: C, held: int) -> tuple[bool, C | None]:
        """`conn` was just accepted while the server held `held` connections (it not
        counted): whether to keep it, and the newcomer to close to make room, if any."""
        if held < self._max_total and len(self._waiting) < self._max:
            self._waiting[conn] = None
            return True, None
        if not self._waiting:  # every slot is held by a peer that showed the token
            return False, None
        oldest = next(iter(self._waiting))
        del self._waiting[oldest]
        self._waiting[conn] = None
        return True, oldest

    def showed_token(self, conn: C) -> bool:
        """`conn` sent a request with the token: it holds its slot from now on. True the
        first time (the caller stops its deadline)."""
        if conn not in self._waiting:
            return False
        del self._waiting[conn]
        return True

    def left(self, conn: C) -> None:
        self._waiting.pop(conn, None)

    def __contains__(self, conn: object) -> bool:
        return conn in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)
