"""HTTP/2 server over asyncio: cleartext with prior knowledge (h2c), or over TLS (ALPN h2,
`common.transport.tls`).

A request is admitted on its HEADERS (route, token, declared size) before any of its body
is read; a refused one is answered at once and the rest of its body dropped unread. Each
connection is held to `ConnectionLimits`: an idle timeout, a cap on connections per server
and on streams per connection, and a budget of streams the peer resets (rapid reset). A
connection that has not shown the token yet is a newcomer: it has `auth_timeout_s` to show
it, may send frames of `NEWCOMER_FRAME_LIMIT` at most, and is closed first when the server
needs its slot (`limits.Newcomers`).

A request whose handler answers at once with a small body is answered while its read is
handled, without a task, and every such answer of one read goes out in one write; any
other request gets a task of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import parse_qsl, unquote, urlsplit

import h2.errors
import h2.events
import h2.exceptions

from common.errors import BadRequest, BagpipeError, Unauthorized, Unavailable
from common.ratelog import RateLimitedLogs
from common.transport.h2base import H2Protocol, StreamGone
from common.transport.http import (
    DEFAULT_MAX_BODY_BYTES,
    Answer,
    Gate,
    PendingAnswer,
    Request,
    Response,
    Route,
    Router,
    StreamResponse,
    body_length,
    body_parts,
    error_response,
    listening,
    query_dict,
    start_handler,
)
from common.transport.limits import LINGER_S, ConnectionLimits, EventWindow, Newcomers
from common.transport.tls import HANDSHAKE_RECORD, NOT_TLS_ANSWER, Tls, TlsListener

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_NOT_H2_BODY = (
    b"This port speaks HTTP/2 with prior knowledge (h2c), not HTTP/1.x.\n"
    b"Use an HTTP/2 client, e.g. curl --http2-prior-knowledge http://HOST:PORT/v1/health,\n"
    b"or this service's HTTP/1.1 port.\n"
)
NOT_H2_ANSWER = (
    b"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-type: text/plain\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_NOT_H2_BODY), _NOT_H2_BODY)
)


#: The largest frame a connection may send before it has shown the token: HTTP/2's default
#: frame size, all a client may assume before it reads our SETTINGS, and more than the
#: requests a newcomer may make (public ones, without a body) need. Frames are handled one
#: at a time, so a request with the token lifts the limit before its body's frames are read.
NEWCOMER_FRAME_LIMIT = 16 * 1024


@dataclass(eq=False)
class _Incoming:
    """A request being received on one stream. `route` is None once it was answered early
    (refused on its headers or its size): the rest of its body is dropped unread."""

    route: Route | None
    head: Request | None = None
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0


class _ServerProtocol(H2Protocol):
    def __init__(self, server: H2Server) -> None:
        super().__init__(
            client_side=False, max_concurrent_streams=server.limits.max_concurrent_streams
        )
        self._server = server
        self._incoming: dict[int, _Incoming] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # stream id → its request's task
        self._refusing = False
        self._closing = False  # GOAWAY sent or turned away: later events are ignored
        self._head = b""  # first bytes, until they prove to be the HTTP/2 preface
        self._preface_seen = False
        self._resets = EventWindow(server.limits.max_resets, server.limits.reset_window_s)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._active_at = 0.0  # loop time of the last activity (`_update_idle`)
        self._auth_timer: asyncio.TimerHandle | None = None  # while a newcomer
        self.peer = "?"

    # -- connection lifecycle ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Our preface waits for the client's (`_check_preface`): an HTTP/1.x client must get
        # a plain answer, not a SETTINGS frame it would show as "HTTP/0.9".
        self.transport = cast(asyncio.Transport, transport)
        self.peer = str(transport.get_extra_info("peername"))
        server = self._server
        keep, evicted = server.newcomers.arrive(self, len(server.connections))
        if not keep:
            server.logs["max_connections"].warning(
                "refused a connection from %s: %d connections open, each has shown the token "
                "(max_connections)", self.peer, len(server.connections),
            )
            self._closing = True
            self.close()
            return
        if evicted is not None:
            evicted.cut_off("max_unauthenticated_connections",
                            "closed the connection from %s to make room: it had not shown the token "
                            "(max_unauthenticated_connections or max_connections)")
        server.connections.add(self)
        self.conn.incoming_buffer.frame_limit = NEWCOMER_FRAME_LIMIT
        loop = asyncio.get_running_loop()
        self._auth_timer = loop.call_later(server.limits.auth_timeout_s, self._auth_expired)
        self._update_idle()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if not self._preface_seen:
            self._head += data
            if not self._check_preface():
                return
            data, self._head = self._head, b""
        super().data_received(data)

    def _receive(self, data: bytes = b"") -> None:
        super()._receive(data)
        self._update_idle()

    def wants_frames(self) -> bool:
        return not self._closing and super().wants_frames()

    def _check_preface(self) -> bool:
        """True once the client's bytes start with the HTTP/2 preface; a client speaking
        anything else is answered (HTTP/1.x) or dropped, with a log line."""
        head = self._head
        n = min(len(head), len(PREFACE))
        if head[:n] == PREFACE[:n]:
            if n < len(PREFACE):
                return False
            self._preface_seen = True
            self.start_connection()
            return True
        self._closing = True
        if head[:1].isupper():  # a request line: GET / HTTP/1.1
            self._server.logs["not_h2"].info(
                "HTTP/1.x request from %s on the HTTP/2 port: answered 505", self.peer
            )
            if self.transport is not None:
                self.transport.write(NOT_H2_ANSWER)
        elif head[:1] == bytes([HANDSHAKE_RECORD]) and self._server.tls is None:
            self._server.logs["not_tls"].warning(
                "TLS handshake from %s on a plaintext port: answered that it does not speak TLS",
                self.peer,
            )
            if self.transport is not None:
                self.transport.write(NOT_TLS_ANSWER)
            self.goaway(linger=True)  # its handshake unread must not reset the answer
            return False
        else:
            self._server.logs["not_h2"].warning(
                "dropped a connection from %s: not HTTP/2 (first bytes %r)", self.peer, head[:16]
            )
        self.close()
        return False

    def protocol_error(self, exc: h2.exceptions.ProtocolError) -> None:
        if isinstance(exc, h2.exceptions.TooManyStreamsError):
            self._server.logs["max_concurrent_streams"].warning(
                "closed the connection from %s: %s (max_concurrent_streams)", self.peer, exc
            )
        else:
            self._server.logs["protocol_error"].warning(
                "HTTP/2 protocol error from %s: %s", self.peer, exc
            )

    def connection_failed(self, error: BaseException) -> None:
        self._closing = True
        self._server.connections.discard(self)
        self._server.newcomers.left(self)
        self._incoming.clear()
        for timer in (self._idle_timer, self._auth_timer):
            if timer is not None:
                timer.cancel()
        self._idle_timer = self._auth_timer = None
        for task in self._tasks.values():
            task.cancel()  # nobody is left to read the answers

    def _update_idle(self) -> None:
        """After any activity: run the idle timer only while no request is in progress, and
        count idleness from now. A timer already running is not moved: it looks at the last
        activity when it fires (requests answered at once come too often to move it each)."""
        loop = asyncio.get_running_loop()
        self._active_at = loop.time()
        busy = bool(self._incoming or self._tasks)
        if busy or self._closing:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        elif self._idle_timer is None:
            self._idle_timer = loop.call_at(self._idle_deadline(), self._idle)

    def _idle_deadline(self) -> float:
        return self._active_at + self._server.limits.idle_timeout_s

    def _idle(self) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self._idle_deadline():  # active since the timer was set
            self._idle_timer = loop.call_at(self._idle_deadline(), self._idle)
            return
        self._idle_timer = None
        self._server.logs["idle_timeout_s"].info(
            "closed the connection from %s: idle for %gs (idle_timeout_s)",
            self.peer, self._server.limits.idle_timeout_s,
        )
        self.goaway(linger=True)

    # -- newcomers: connections that have not shown the token yet ----------------------
    def _showed_token(self) -> None:
        """A request with the token: the connection holds its slot from now on."""
        if self._server.newcomers.showed_token(self):
            self.conn.incoming_buffer.frame_limit = None
            if self._auth_timer is not None:
                self._auth_timer.cancel()
                self._auth_timer = None

    def _auth_expired(self) -> None:
        self._auth_timer = None
        if self in self._server.newcomers:
            self.cut_off("auth_timeout_s", "closed the connection from %s: no request with the "
                         f"token within {self._server.limits.auth_timeout_s:g}s (auth_timeout_s)")

    def cut_off(self, limit: str, message: str) -> None:
        """Close a newcomer now, with GOAWAY if it spoke HTTP/2 (`message` % its peer, logged
        rate-limited under `limit`): nobody with the token waits for an answer on it."""
        self._server.logs[limit].info(message, self.peer)
        self._fail(Unavailable(f"connection closed: {limit}"))
        self.goaway()

    # -- events from the reader -------------------------------------------------------
    def handle_event(self, event: h2.events.Event) -> None:
        if self._closing:
            return
        if isinstance(event, h2.events.RequestReceived):
            self._request_received(event)
        elif isinstance(event, h2.events.DataReceived):
            self._data_received(event)
        elif isinstance(event, h2.events.StreamEnded):
            self._stream_ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self._stream_reset(event)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()

    def _request_received(self, event: h2.events.RequestReceived) -> None:
        """Admit a request on its headers. A stream the peer already reset is judged too: a
        rapid-reset flood without the token ends at its first stream."""
        stream_id = event.stream_id
        stream = self.conn.streams.get(stream_id)
        live = stream is not None and not stream.closed
        if self._refusing and live:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            self._count_reset()
            return
        try:
            head = _request_head(dict(event.headers or []))
            if self._auth_timer is not None and self._server.gate.shows_token(head.headers):
                self._showed_token()
            route = self._server.gate.admit(head.method, head.path, head.headers)
        except Unauthorized as err:
            self._turn_away(stream_id if live else None, err)
            return
        except BagpipeError as err:
            self._charge_unauthenticated()
            if live:
                self._refuse(stream_id, err)
            return
        if route.public:
            self._charge_unauthenticated()
        if live:
            self._incoming[stream_id] = _Incoming(route=route, head=head)

    def _data_received(self, event: h2.events.DataReceived) -> None:
        stream_id, size = event.stream_id, event.flow_controlled_length
        incoming = self._incoming.get(stream_id)
        if incoming is None or incoming.route is None:
            # Dropped unread. The connection gets its credit back (the other streams must
            # not starve); this stream does not, so its sender stalls once its window is
            # spent instead of streaming a body nobody reads.
            if size:
                self.conn.increment_flow_control_window(size)
            return
        # Unary bodies are buffered whole, so credit goes back at once.
        self.conn.acknowledge_received_data(size, stream_id)
        data = event.data or b""
        incoming.size += len(data)
        gate = self._server.gate
        if incoming.size > gate.body_limit(incoming.route):
            self._refuse(stream_id, gate.too_large(gate.body_limit(incoming.route)))
            return
        incoming.chunks.append(data)

    def _stream_ended(self, stream_id: int) -> None:
        incoming = self._incoming.pop(stream_id, None)
        if incoming is None or incoming.route is None or incoming.head is None:
            return
        head = incoming.head
        request = Request(method=head.method, path=head.path, query=head.query,
                          headers=head.headers, body=b"".join(incoming.chunks))
        answer = start_handler(incoming.route, request)
        if isinstance(answer, Response) and self._answer_now(stream_id, answer):
            return
        self._spawn(stream_id, self._serve(stream_id, answer), awaiting=answer)

    def _stream_reset(self, event: h2.events.StreamReset) -> None:
        self._incoming.pop(event.stream_id, None)
        if task := self._tasks.get(event.stream_id):
            task.cancel()  # its handler's work is wasted now: stop it
        if event.remote_reset:
            self._count_reset()

    def _refuse(self, stream_id: int, err: BagpipeError) -> None:
        """Answer `err` now and ask the client to stop sending (RST_STREAM NO_ERROR, RFC
        9113 §8.1); the connection and its other streams carry on."""
        self._incoming[stream_id] = _Incoming(route=None)
        self._spawn(stream_id, self._answer(stream_id, error_response(err), stop_upload=True))

    def _turn_away(self, stream_id: int | None, err: Unauthorized) -> None:
        """A request without the token: answered (if its stream is still open), then GOAWAY.
        A peer without the token gets one answer per connection, and what it sends after is
        left unread (`goaway`), so floods of unauthenticated streams or uploads cost a
        connection set-up each."""
        self._server.gate.turned_away(self.peer, self._server.logs)
        if stream_id is not None:
            self._answer_now(stream_id, error_response(err))
        self._fail(Unavailable("connection closed: a request without the token"))
        self.goaway(linger=True, unread=True)

    def _charge_unauthenticated(self) -> None:
        """One more request answered without the token; past the server's budget this
        connection is read again only once the rate allows (`ConnectionLimits`)."""
        server = self._server
        wait = server.gate.unauthenticated(asyncio.get_running_loop().time(), self.peer, server.logs)
        if wait > 0:
            self.hold_reading(wait)

    def _count_reset(self) -> None:
        """One more stream reset by the peer or refused; past the budget the peer is
        flooding us with streams it never means to finish (CVE-2023-44487)."""
        if not self._resets.hit(asyncio.get_running_loop().time()):
            return
        limits = self._server.limits
        self._server.logs["max_resets"].warning(
            "closed the connection from %s: over %d streams reset in %gs (max_resets): GOAWAY "
            "ENHANCE_YOUR_CALM", self.peer, limits.max_resets, limits.reset_window_s,
        )
        self._fail(Unavailable("connection closed: too many streams reset"))  # cancels the work
        self.goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, linger=True, unread=True)

    # -- request tasks --------------------------------------------------------------------
    def _spawn(self, stream_id: int, coro: object, awaiting: object = None) -> None:
        """Run `coro` as the stream's task; `awaiting` is the handler's answer it takes over
        (a `PendingAnswer`), closed if the task is cancelled before it started (so that the
        handler's coroutine is not left never awaited)."""
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks[stream_id] = task
        self._server.tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(stream_id, t, awaiting))

    def _task_done(self, stream_id: int, task: asyncio.Task[None], awaiting: object) -> None:
        if task.cancelled() and isinstance(awaiting, PendingAnswer):
            awaiting.close()  # a no-op once it has run
        self._tasks.pop(stream_id, None)
        self._incoming.pop(stream_id, None)  # answered: the rest of an upload is not read
        self._server.tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("request task failed", exc_info=exc)
        self._update_idle()

    def _answer_now(self, stream_id: int, response: Response) -> bool:
        """Queue the frames of an answer with a small body, to go out in the write that ends
        `data_received`; False (nothing sent) if it must wait for a window or the transport."""
        try:
            parts = body_parts(response.body)
            length = body_length(parts)
            if length and not self.fits_now(stream_id, length):
                return False
            self._send_headers(stream_id, response, length)
            if length:
                self.send_small_body(stream_id, parts)
        except Exception as exc:
            self._answer_failed(stream_id, exc)
        return True

    async def _serve(self, stream_id: int, answer: Answer | Awaitable[Answer]) -> None:
        if not isinstance(answer, Response | StreamResponse):
            answer = await answer
        await self._answer(stream_id, answer)

    async def _answer(self, stream_id: int, result: Answer, *, stop_upload: bool = False) -> None:
        try:
            if isinstance(result, StreamResponse):
                await self._send_stream(stream_id, result)
                return
            await self._send_response(stream_id, result)
            stream = self.conn.streams.get(stream_id)
            if stop_upload and stream is not None and not stream.closed:
                self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
                self.flush()
        except Exception as exc:
            self._answer_failed(stream_id, exc)

    def _answer_failed(self, stream_id: int, exc: Exception) -> None:
        if isinstance(exc, StreamGone | Unavailable | h2.exceptions.ProtocolError):
            # The client reset the stream or the connection died: nobody to answer.
            logger.debug("answer on stream %d dropped: %s", stream_id, exc)
            return
        # A malformed Response must not leave the client waiting for its timeout.
        logger.error("sending the answer on stream %d failed", stream_id, exc_info=exc)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
            self.flush()

    async def _send_response(self, stream_id: int, response: Response) -> None:
        parts = body_parts(response.body)
        length = body_length(parts)
        self._send_headers(stream_id, response, length)
        self.flush()
        if length:
            await self.send_body(stream_id, parts, end_stream=True)

    def _send_headers(self, stream_id: int, response: Response, length: int) -> None:
        headers = _response_headers(response.status, response.content_type, response.headers)
        headers.append(("content-length", str(length)))
        self.conn.send_headers(stream_id, headers, end_stream=length == 0)

    async def _send_stream(self, stream_id: int, response: StreamResponse) -> None:
        headers = _response_headers(response.status, response.content_type, response.headers)
        self.conn.send_headers(stream_id, headers)
        self.flush()
        chunks = response.chunks
        try:
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except Exception:
                    logger.exception("stream producer on stream %d failed", stream_id)
                    self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                    self.flush()
                    return
                # The next chunk is asked for only once the window took this one.
                await self.send_body(stream_id, [chunk], end_stream=False)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        self.conn.end_stream(stream_id)
        self.flush()

    # -- shutdown -------------------------------------------------------------------------
    def refuse_new_streams(self) -> None:
        self._refusing = True

    def pending(self) -> list[asyncio.Task[None]]:
        return list(self._tasks.values())

    def goaway(
        self, error_code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR, *,
        linger: bool = False, unread: bool = False,
    ) -> None:
        """Send GOAWAY and close. With `linger`, the connection is half-closed and the peer's
        further bytes dropped unread until it closes too (at most `LINGER_S`): closing with
        its frames still unread makes the kernel reset the connection, which can destroy
        the GOAWAY before the peer reads it. With `unread` (a peer cut off for abuse), the
        socket is not even read meanwhile: a peer that goes on sending is held back by TCP's
        flow control rather than read at our expense, and the close waits the full
        `LINGER_S`."""
        self._closing = True
        if self._preface_seen:
            with contextlib.suppress(Exception):
                self.conn.close_connection(error_code=error_code)
                self.flush()
        transport = self.transport
        if linger and transport is not None and transport.can_write_eof():
            if unread:
                self._pause_reading()
            transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.close)
        else:
            self.close()


def _response_headers(
    status: int, content_type: str, extra: dict[str, str]
) -> list[tuple[str, str]]:
    headers = [(":status", str(status)), ("content-type", content_type)]
    headers += [(k.lower(), v) for k, v in extra.items()]
    return headers


def _request_head(headers: dict[str, str]) -> Request:
    """The request a HEADERS frame announces, its body still to come."""
    method, raw_path = headers.get(":method"), headers.get(":path")
    if not method or not raw_path:
        raise BadRequest("request without :method or :path")
    path, query = _split_path(raw_path)
    return Request(
        method=method,
        path=path,
        query=query_dict(query),
        headers={k: v for k, v in headers.items() if not k.startswith(":")},
        body=b"",
    )


@functools.lru_cache(maxsize=256)
def _split_path(raw_path: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The percent-decoded path and the query of a `:path`; remembered, since a client sends
    the same few paths over and over (parsing one costs a microsecond, 1% of a small fetch)."""
    try:
        url = urlsplit(raw_path)
    except ValueError as exc:
        raise BadRequest(f"malformed :path: {exc}") from None
    return unquote(url.path), tuple(parse_qsl(url.query))


class H2Server:
    """Serves a `Router` over h2c, or over TLS with `tls`. `port=0` binds a free port,
    reported by `.port`.

    `token=None` disables the bearer check; `limits` bounds connections and streams. With
    `sock` (a socket already listening), it serves that instead of binding host and port.
    `stop()` refuses new streams, lets in-flight requests finish for up to `grace` seconds,
    then sends GOAWAY and closes (h2 allows no frame after GOAWAY, so in-flight work has to
    finish first). An address it cannot listen on is `Unavailable` naming it.
    """

    def __init__(
        self,
        router: Router,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        limits: ConnectionLimits = ConnectionLimits(),
        grace: float = 5.0,
        sock: socket.socket | None = None,
        tls: Tls | None = None,
    ) -> None:
        self.gate = Gate(router, token, max_body_bytes, limits)
        self.limits = limits
        self.tls = tls
        self._sock = sock
        self.logs = RateLimitedLogs(logger)  # for what peers can provoke at will
        self.connections: set[_ServerProtocol] = set()
        self.newcomers: Newcomers[_ServerProtocol] = Newcomers(limits)
        self.tasks: set[asyncio.Task[None]] = set()
        self._host, self._port, self._grace = host, port, grace
        self._server: asyncio.Server | TlsListener | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def connection_count(self) -> int:
        """Connections held now (newcomers included)."""
        return len(self.connections)

    def connection(self) -> asyncio.Protocol:
        """The protocol of one new connection, as `start` gives the event loop for each; a
        benchmark may drive one with bytes of its own (`bench/ps_fetch.py`)."""
        return _ServerProtocol(self)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.tls is not None:
            listener = TlsListener(self.connection, self.tls, "h2", self.limits, self.logs)
            async with listening(self._host, self._port):
                await listener.start(self._host, self._port, backlog=self.limits.max_connections, sock=self._sock)
            self._server = listener
        elif self._sock is not None:
            self._server = await loop.create_server(self.connection, sock=self._sock)
        else:
            async with listening(self._host, self._port):
                self._server = await loop.create_server(
                    self.connection, self._host, self._port, backlog=self.limits.max_connections
                )
        logger.info("h2 server listening on %s:%d%s", self._host, self.port, " (TLS)" if self.tls else "")

    async def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        connections = list(self.connections)
        for proto in connections:
            proto.refuse_new_streams()
        pending = [t for proto in connections for t in proto.pending()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._grace)
            for task in late:
                task.cancel()
        for proto in connections:
            proto.goaway()
        await server.wait_closed()
