"""Transport-neutral HTTP types, the route table and the admission and dispatch both servers
share.

A request is admitted on its headers (`Gate`) before its body is read; its handler then
receives a fully buffered `Request` and returns a `Response` or a `StreamResponse`, or an
awaitable of one. It raises a `BagpipeError` to answer with that error's status and JSON
body; any other exception becomes a logged 500, so a handler bug never takes a connection
down.

A handler that can answer at once (a plain function returning a `Response`) is answered
without a task: the HTTP/2 server sends such answers while it handles the read that
completed their requests, all in one write. An `async def` handler always gets a task.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from common.errors import (
    BadRequest,
    BagpipeError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    clipped,
    error_from_json,
    quoted,
)
from common.ratelog import RateLimitedLogs
from common.transport.limits import ConnectionLimits, TokenBucket

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
JSON = "application/json"

Body = bytes | Sequence[bytes | memoryview]


@dataclass(frozen=True, kw_only=True)
class Request:
    """One buffered request. Header names are lower-case; `path` is percent-decoded."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes


@dataclass(kw_only=True)
class Response:
    """A complete answer. `body` may be a list of buffers: they are sent without joining."""

    status: int = 200
    body: bytes | list[bytes | memoryview] = b""
    content_type: str = "application/octet-stream"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Response:
        return cls(status=status, body=orjson.dumps(obj, default=str), content_type=JSON)


@dataclass(kw_only=True)
class StreamResponse:
    """An answer sent chunk by chunk as `chunks` yields them.

    The server advances `chunks` only when the peer's flow-control window (HTTP/2) or the
    socket (HTTP/1.1) accepts the previous chunk, and closes it (`aclose`) when the peer goes
    away: a producer that yields lazily is paced by its consumer.
    """

    status: int = 200
    content_type: str = "application/octet-stream"
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ClientResponse:
    status: int
    headers: dict[str, str]
    body: bytes


Answer = Response | StreamResponse
#: A route's handler: its answer, or an awaitable of it when it must wait for something.
Handler = Callable[[Request], Answer | Awaitable[Answer]]


@dataclass(frozen=True, kw_only=True)
class Route:
    handler: Handler
    public: bool


class Router:
    """Explicit route table: exact (method, path) pairs, no patterns."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Route]] = {}

    def add(self, method: str, path: str, handler: Handler, *, public: bool = False) -> None:
        """Register `handler`; `public` routes (health, metrics) skip the token check."""
        by_method = self._routes.setdefault(path, {})
        method = method.upper()
        if method in by_method:
            raise ValueError(f"route {method} {path} registered twice")
        by_method[method] = Route(handler=handler, public=public)

    def registered(self) -> set[tuple[str, str]]:
        """Every (method, path) with a handler."""
        return {(method, path) for path, by_method in self._routes.items() for method in by_method}

    def resolve(self, method: str, path: str) -> Route:
        """The route for a request; raises NotFound (404) or MethodNotAllowed (405)."""
        by_method = self._routes.get(path)
        if by_method is None:
            raise NotFound(f"no route for {path}", path=path)
        route = by_method.get(method.upper())
        if route is None:
            raise MethodNotAllowed(
                f"{method} not allowed on {path}", path=path, allowed=sorted(by_method)
            )
        return route


class TokenCheck:
    """Bearer-token check in constant time; `token=None` disables it (tests, tools)."""

    def __init__(self, token: str | None) -> None:
        self._expected = None if token is None else f"Bearer {token}".encode()

    def check(self, headers: dict[str, str]) -> None:
        if not self.valid(headers):
            raise Unauthorized("missing or wrong bearer token")

    def valid(self, headers: dict[str, str]) -> bool:
        """Whether `headers` carry the token (always, when the check is disabled)."""
        if self._expected is None:
            return True
        given = headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._expected)


def query_dict(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A request's query parameters by name; BadRequest naming one given twice, whose
    meaning would depend on which one a server happens to keep."""
    query: dict[str, str] = {}
    for name, value in pairs:
        if name in query:
            raise BadRequest(f"query parameter {quoted(name)} is given twice", parameter=clipped(name))
        query[name] = value
    return query


@contextlib.asynccontextmanager
async def listening(host: str, port: int) -> AsyncIterator[None]:
    """Wraps a server's bind: an address it cannot listen on (in use, not this machine's)
    is an `Unavailable` naming it, one line for the operator, not a socket traceback."""
    try:
        yield
    except OSError as exc:
        hint = (": another process listens there (a second instance of this role?)"
                if exc.errno == errno.EADDRINUSE else "")
        reason = exc.strerror or str(exc)
        raise Unavailable(f"cannot listen on {host}:{port}: {reason}{hint}", address=f"{host}:{port}") from None


def error_response(err: BagpipeError) -> Response:
    return Response.json(err.to_json(), status=err.status)


class Gate:
    """What a server decides from a request's headers alone, before it reads any body: an
    unauthenticated or oversized upload is refused without being buffered. It also keeps the
    server's budget for requests answered without the token (`ConnectionLimits`)."""

    def __init__(
        self, router: Router, token: str | None, max_body_bytes: int,
        limits: ConnectionLimits = ConnectionLimits(),
    ) -> None:
        self.router = router
        self.auth = TokenCheck(token)
        self.max_body_bytes = max_body_bytes
        self._rate = limits.unauthenticated_rate
        self._unauthenticated = TokenBucket(limits.unauthenticated_rate, limits.unauthenticated_burst)

    def admit(self, method: str, path: str, headers: dict[str, str]) -> Route:
        """The route for these headers; raises NotFound, MethodNotAllowed, Unauthorized (a
        route that is not public, without the token) or PayloadTooLarge (a declared
        Content-Length over the limit)."""
        route = self.router.resolve(method, path)
        if not route.public:
            self.auth.check(headers)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.body_limit(route):
            raise self.too_large(self.body_limit(route))
        return route

    def body_limit(self, route: Route) -> int:
        """The largest body `route` takes. Public routes (probes, scrapes) take none: a peer
        without the token cannot make the server buffer a body."""
        return 0 if route.public else self.max_body_bytes

    def shows_token(self, headers: dict[str, str]) -> bool:
        """Whether a request carries the token, admitted or not: its connection then holds
        its slot (`limits.Newcomers`)."""
        return self.auth.valid(headers)

    def too_large(self, limit: int | None = None) -> PayloadTooLarge:
        limit = self.max_body_bytes if limit is None else limit
        return PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)

    def unauthenticated(self, now: float, peer: str, logs: RateLimitedLogs) -> float:
        """One more request answered without the token (a public route, a refusal): the
        seconds the connection that sent it is not to be read, 0.0 within the budget."""
        wait = self._unauthenticated.take(now)
        if wait > 0:
            logs["unauthenticated_rate"].warning(
                "unauthenticated requests over %g/s (unauthenticated_rate): reading from %s "
                "held for %.0f ms", self._rate, peer, wait * 1e3,
            )
        return wait

    @staticmethod
    def turned_away(peer: str, logs: RateLimitedLogs) -> None:
        """Log a connection closed after answering a request without the token: a peer
        without it gets one answer per connection."""
        logs["unauthorized"].warning(
            "closed the connection from %s: a request without the bearer token", peer
        )


def start_handler(route: Route, request: Request) -> Answer | Awaitable[Answer]:
    """Call an admitted request's handler: its answer if it gave one at once, else an
    awaitable of it. Every failure becomes an error answer."""
    try:
        result = route.handler(request)
    except Exception as exc:
        return _failed(request, exc)
    if isinstance(result, Response | StreamResponse):
        return result
    if inspect.isawaitable(result):
        return PendingAnswer(result, request)
    return _not_an_answer(request, result)


class PendingAnswer:
    """What `start_handler` gives for a handler that has to wait: an awaitable of its answer,
    every failure an error answer. A server that will never await it (its request was
    cancelled first) calls `close`, which closes the handler's coroutine too: left unawaited,
    it would warn when collected."""

    __slots__ = ("_pending", "_request")

    def __init__(self, pending: Awaitable[object], request: Request) -> None:
        self._pending, self._request = pending, request

    def __await__(self) -> Generator[Any, None, Answer]:
        return _finish_handler(self._pending, self._request).__await__()

    def close(self) -> None:
        """Close the handler's coroutine, or its `Then` (a no-op once it has run)."""
        if isinstance(self._pending, Then) or inspect.iscoroutine(self._pending):
            self._pending.close()


class Then:
    """``then(await answer)``, for a handler whose answer is encoded once it comes.

    An ``async def`` wrapper taking `answer` would, closed unstarted by `PendingAnswer.close`
    (its request cancelled before its task ran), drop the handler's coroutine never awaited:
    that one was made when the handler was called. This closes it too."""

    __slots__ = ("_answer", "_then")

    def __init__(self, answer: Awaitable[Any], then: Callable[[Any], Answer]) -> None:
        self._answer, self._then = answer, then

    def __await__(self) -> Generator[Any, None, Answer]:
        return self._run().__await__()

    async def _run(self) -> Answer:
        return self._then(await self._answer)

    def close(self) -> None:
        if inspect.iscoroutine(self._answer):
            self._answer.close()


async def _finish_handler(pending: Awaitable[object], request: Request) -> Answer:
    try:
        result = await pending
    except Exception as exc:
        return _failed(request, exc)
    if isinstance(result, Response | StreamResponse):
        return result
    return _not_an_answer(request, result)


def _failed(request: Request, exc: Exception) -> Response:
    """The answer to a handler that raised: the error's own for a `BagpipeError`, else a
    logged 500."""
    if isinstance(exc, BagpipeError):
        return error_response(exc)
    logger.error("handler for %s %s failed", request.method, request.path, exc_info=exc)
    return error_response(BagpipeError("internal server error"))


def _not_an_answer(request: Request, result: object) -> Response:
    logger.error("handler for %s %s returned %r", request.method, request.path, result)
    return error_response(BagpipeError("internal server error"))


async def run_handler(route: Route, request: Request) -> Answer:
    """Run an admitted request's handler to its answer; every failure becomes an error answer."""
    started = start_handler(route, request)
    if isinstance(started, Response | StreamResponse):
        return started
    return await started


def body_parts(body: Body) -> list[bytes | memoryview]:
    return [body] if isinstance(body, bytes | bytearray | memoryview) else list(body)


def body_length(parts: Sequence[bytes | memoryview]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def auth_headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


def raise_for_answer(status: int, body: bytes) -> None:
    """Raise the error a non-2xx answer carries, rebuilt with `error_from_json`."""
    if 200 <= status < 300:
        return
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        payload = {"message": f"HTTP {status}: {body[:200]!r}"}
    raise error_from_json(status, payload)


class Client(abc.ABC):
    """What every transport's client offers; `connect_client` picks one from the spec."""

    @abc.abstractmethod
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> ClientResponse:
        """One exchange, any status. Raises Unavailable (peer unreachable or gone) or
        TimedOut (`timeout`, default the client's, bounds the whole exchange)."""

    @abc.abstractmethod
    def stream(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        """The response body chunk by chunk, as it arrives; flow-control credit is returned
        only as chunks are taken, so a slow consumer slows the producer. `timeout` bounds the
        wait for the headers and for each chunk. A non-2xx answer raises its error. Wrap in
        `contextlib.aclosing` to cancel the stream at once when leaving early."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Drop the connection(s); in-flight requests fail with Unavailable."""

    async def call(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> bytes:
        """The body of a 2xx answer; any other answer raises the error it carries."""
        resp = await self.request(method, path, body=body, headers=headers, timeout=timeout)
        raise_for_answer(resp.status, resp.body)
        return resp.body
