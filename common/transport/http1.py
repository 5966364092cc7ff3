"""The same routes over HTTP/1.1 keep-alive with aiohttp, cleartext or over TLS: for tools
(curl, Prometheus) and as the alternative data plane named in the cluster spec."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import warnings
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
from aiohttp import web

from common.errors import BagpipeError, TimedOut, Unauthorized, Unavailable
from common.ratelog import RateLimitedLog, RateLimitedLogs
from common.transport.http import (
    DEFAULT_MAX_BODY_BYTES,
    Body,
    Client,
    ClientResponse,
    Gate,
    Request,
    Response,
    Route,
    Router,
    StreamResponse,
    auth_headers,
    body_parts,
    error_response,
    listening,
    query_dict,
    raise_for_answer,
    run_handler,
)
from common.transport.limits import LINGER_S, ConnectionLimits, Newcomers
from common.transport.links import watched_socket
from common.transport.tls import HANDSHAKE_RECORD, NOT_TLS_ANSWER, Tls, TlsListener, connect_error

logger = logging.getLogger(__name__)


class Http1Server:
    """Serves a `Router` with aiohttp; same auth, limits and error JSON as `H2Server`.

    A request is admitted on its headers (route, token, declared Content-Length) before
    its body is read; a refused one is answered and its connection closed. `limits` gives
    the idle timeout (aiohttp's keep-alive timeout, which also covers a connection that
    never sends a request), the cap on connections and the newcomers' deadline and budget
    (`limits.Newcomers`, as on HTTP/2). `port=0` binds a free port, reported by `.port`.
    `stop()` lets in-flight requests finish for up to `grace` seconds. With `sock` (a socket
    already listening) it serves that instead of binding host and port; an address it
    cannot listen on is `Unavailable` naming it. With `tls` it speaks TLS (ALPN http/1.1).
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
        self._sock = sock
        self.tls = tls
        self._gate = Gate(router, token, max_body_bytes, limits)
        self._limits = limits
        self._host, self._port, self._grace = host, port, grace
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | TlsListener | None = None
        self._logs = RateLimitedLogs(logger)  # for what peers can provoke at will
        self._newcomers: Newcomers[web.RequestHandler] = Newcomers(limits)
        self._watched: dict[web.RequestHandler, _Watched] = {}  # the newcomers' wrappers

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return int(self._listener.sockets[0].getsockname()[1])

    @property
    def connection_count(self) -> int:
        """Connections held now (newcomers included)."""
        server = None if self._runner is None else self._runner.server
        return 0 if server is None else len(server.connections)

    async def start(self) -> None:
        app = web.Application(client_max_size=self._gate.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=self._grace,
            keepalive_timeout=self._limits.idle_timeout_s,
            # aiohttp's default is 10 s of reading a refused upload's rest, which also holds
            # `stop()` for its whole grace period.
            lingering_time=LINGER_S,
            logger=_OneLineLog(self._logs["bad_request"]),
        )
        await runner.setup()
        loop = asyncio.get_running_loop()
        # Our own listener rather than a TCPSite: every accepted socket passes `_accept`.
        try:
            if self.tls is not None:
                listener = TlsListener(self._accept, self.tls, "http1", self._limits, self._logs)
                async with listening(self._host, self._port):
                    await listener.start(self._host, self._port, backlog=self._limits.max_connections,
                                         sock=self._sock)
                self._listener = listener
            elif self._sock is not None:
                self._listener = await loop.create_server(self._accept, sock=self._sock)
            else:
                async with listening(self._host, self._port):
                    self._listener = await loop.create_server(
                        self._accept, self._host, self._port, backlog=self._limits.max_connections
                    )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        logger.info("http/1.1 server listening on %s:%d%s", self._host, self.port, " (TLS)" if self.tls else "")

    async def stop(self) -> None:
        listener, self._listener = self._listener, None
        runner, self._runner = self._runner, None
        if listener is not None:
            listener.close()
        if runner is not None:
            await runner.cleanup()
        if listener is not None:
            await listener.wait_closed()

    def _accept(self) -> asyncio.BaseProtocol:
        """aiohttp's protocol for a new connection, watched until it shows the token; or one
        that closes it at once when every slot is held by peers that have shown it."""
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        handler = server()
        keep, evicted = self._newcomers.arrive(handler, len(server.connections))
        if not keep:
            self._logs["max_connections"].warning(
                "refused a connection: %d connections open, each has shown the token "
                "(max_connections)", len(server.connections),
            )
            return _Refused()
        if evicted is not None:
            self._cut_off(evicted, "max_unauthenticated_connections",
                          "closed a connection to make room: it had not shown the token "
                            "(max_unauthenticated_connections or max_connections)")
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self._limits.auth_timeout_s, self._auth_expired, handler)
        plaintext_logs = None if self.tls is not None else self._logs
        watched = self._watched[handler] = _Watched(handler, deadline, self._left, plaintext_logs)
        return watched

    def _showed_token(self, handler: web.RequestHandler) -> None:
        if self._newcomers.showed_token(handler):
            self._watched.pop(handler).deadline.cancel()

    def _auth_expired(self, handler: web.RequestHandler) -> None:
        if handler in self._newcomers:
            self._cut_off(handler, "auth_timeout_s", "closed a connection: no request with the "
                          f"token within {self._limits.auth_timeout_s:g}s (auth_timeout_s)")

    def _cut_off(self, handler: web.RequestHandler, limit: str, message: str) -> None:
        self._logs[limit].info(message)
        self._left(handler)
        handler.force_close()

    def _left(self, handler: web.RequestHandler) -> None:
        self._newcomers.left(handler)
        watched = self._watched.pop(handler, None)
        if watched is not None:
            watched.deadline.cancel()

    async def _handle(self, raw: web.Request) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in raw.headers.items()}
        if raw.protocol in self._newcomers and self._gate.shows_token(headers):
            self._showed_token(raw.protocol)
        try:
            route = self._gate.admit(raw.method, raw.path, headers)
            query = query_dict(raw.query.items())
        except Unauthorized as err:
            self._gate.turned_away(str(raw.remote), self._logs)
            return _turned_away(raw, error_response(err))
        except BagpipeError as err:
            await self._charge_unauthenticated(raw)
            return _early(raw, error_response(err))
        if route.public:
            await self._charge_unauthenticated(raw)
        body = await self._body(raw, route)
        if isinstance(body, web.Response):
            return body
        request = Request(method=raw.method, path=raw.path, query=query, headers=headers, body=body)
        result = await run_handler(route, request)
        if isinstance(result, Response):
            return _plain(result)
        return await _stream(raw, result)

    async def _body(self, raw: web.Request, route: Route) -> bytes | web.Response:
        """The request's body, or the answer to give instead when it cannot be read whole.
        Public routes take none (`Gate.body_limit`): aiohttp drops what comes unread."""
        if route.public:
            return b""
        try:
            return await raw.read()
        except BagpipeError as err:
            return _early(raw, error_response(err))
        except web.HTTPRequestEntityTooLarge:
            return _early(raw, error_response(self._gate.too_large()))
        except ConnectionError as exc:
            # The peer left mid-body; nobody reads an answer, aiohttp drops it quietly.
            self._logs["lost_mid_body"].info("connection from %s lost mid-body: %s", raw.remote, exc)
            return _early(raw, error_response(Unavailable("request body incomplete")))

    async def _charge_unauthenticated(self, raw: web.Request) -> None:
        """One more request answered without the token; past the budget its answer waits
        until the rate allows (`ConnectionLimits`). HTTP/1.1 answers a connection's requests
        in order, so the connection's next requests wait too, and aiohttp's own flow control
        stops reading it once a few are queued."""
        loop = asyncio.get_running_loop()
        wait = self._gate.unauthenticated(loop.time(), str(raw.remote), self._logs)
        if wait > 0:
            await asyncio.sleep(wait)  # the rate limit itself, not a wait for an event


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection, passed every event, telling the server when the
    connection is gone (aiohttp offers no hook for that): a newcomer's bookkeeping must not
    outlive it. On a plaintext port (`plaintext_logs` given), a TLS handshake is answered
    with `NOT_TLS_ANSWER` and a log line, not passed to aiohttp."""

    def __init__(self, handler: web.RequestHandler, deadline: asyncio.TimerHandle,
                 left: Callable[[web.RequestHandler], None], plaintext_logs: RateLimitedLogs | None = None) -> None:
        self.handler, self.deadline, self._left = handler, deadline, left
        self._plaintext_logs = plaintext_logs  # None once the first bytes were looked at
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._plaintext_logs is not None:
            logs, self._plaintext_logs = self._plaintext_logs, None
            self._refused = data[:1] == bytes([HANDSHAKE_RECORD])
            if self._refused:
                logs["not_tls"].warning("TLS handshake from %s on a plaintext port: answered that it does "
                                        "not speak TLS", self._transport.get_extra_info("peername"))
                _answer_and_close(self._transport, NOT_TLS_ANSWER)
        if not self._refused:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._left(self.handler)
        self.handler.connection_lost(exc)


def _answer_and_close(transport: asyncio.BaseTransport, answer: bytes) -> None:
    """Send `answer`, then close once the peer has read it (at most `LINGER_S` later): closing
    with its bytes unread would make the kernel reset the connection over the answer."""
    writer: asyncio.Transport = transport  # type: ignore[assignment]
    writer.write(answer)
    if writer.can_write_eof():
        writer.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, writer.close)
    else:
        writer.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _OneLineLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, for errors a peer can provoke at will (malformed requests,
    lost connections): one rate-limited line each, without the traceback aiohttp attaches;
    debug lines pass through."""

    def __init__(self, lines: RateLimitedLog) -> None:
        super().__init__(logging.getLogger(f"{__name__}.aiohttp"), {})
        self._lines = lines

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        if level < logging.WARNING:
            super().log(level, msg, *args, **kwargs)
            return
        exc = kwargs.get("exc_info")
        if isinstance(exc, BaseException):
            msg, args = f"{msg}: %r", (*args, exc)
        self._lines.log(level, str(msg), *args)


def _early(raw: web.Request, response: Response) -> web.Response:
    """An answer given before the body was read: if some of it has yet to arrive, the
    connection closes after the answer, so that body is never buffered (what arrives of it
    meanwhile is read and dropped for at most `LINGER_S`)."""
    out = _plain(response)
    if not raw.content.is_eof():
        out.force_close()
    return out


def _turned_away(raw: web.Request, response: Response) -> web.Response:
    """The answer to a request without the token, after which the connection closes. Its
    body is not read at all: reading stops and the body is marked ended, as aiohttp would
    otherwise read and drop the rest of it (lingering close) at our expense."""
    out = _plain(response)
    out.force_close()
    if not raw.content.is_eof() and raw.transport is not None:
        raw.transport.pause_reading()
        raw.content.feed_eof()
    return out


def _plain(response: Response) -> web.Response:
    body = response.body if isinstance(response.body, bytes) else b"".join(response.body)
    headers = {"Content-Type": response.content_type, **response.headers}
    return web.Response(status=response.status, body=body, headers=headers)


async def _stream(raw: web.Request, response: StreamResponse) -> web.StreamResponse:
    out = web.StreamResponse(
        status=response.status, headers={"Content-Type": response.content_type, **response.headers}
    )
    chunks = response.chunks
    try:
        await out.prepare(raw)
        # write() waits for the socket to drain: the producer is paced by the reader.
        async for chunk in chunks:
            await out.write(chunk)
        await out.write_eof()
    except ConnectionError as exc:
        logger.debug("stream to %s dropped: %s", raw.remote, exc)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    return out


class Http1Client(Client):
    """`H2Client`'s interface over an aiohttp keep-alive pool (one session, lazily made);
    over TLS with `tls`."""

    def __init__(
        self, host: str, port: int, *, token: str | None = None, timeout: float = 30.0,
        tls: Tls | None = None,
    ) -> None:
        self._base = f"{'http' if tls is None else 'https'}://{host}:{port}"
        self._timeout = timeout
        self._auth = auth_headers(token)
        self._ssl = False if tls is None else tls.client
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._auth,
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl, socket_factory=watched_socket),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> ClientResponse:
        limit = self._timeout if timeout is None else timeout
        with _translate(f"{method} {path} to {self._base}", limit):
            async with self._client().request(
                method,
                self._base + path,
                data=_joined(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=limit),
            ) as resp:
                data = await resp.read()
                return ClientResponse(
                    status=resp.status,
                    headers={k.lower(): v for k, v in resp.headers.items()},
                    body=data,
                )

    async def stream(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        limit = self._timeout if timeout is None else timeout
        what = f"{method} {path} to {self._base}"
        per_read = aiohttp.ClientTimeout(total=None, sock_connect=limit, sock_read=limit)
        with _translate(what, limit):
            resp = await self._client().request(
                method, self._base + path, data=_joined(body), headers=headers, timeout=per_read
            )
        try:
            if not 200 <= resp.status < 300:
                with _translate(what, limit):
                    raise_for_answer(resp.status, await resp.read())
            while True:
                with _translate(what, limit):
                    chunk = await resp.content.readany()
                if not chunk:
                    break
                yield chunk
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()  # an unfinished body cannot be reused: drop that connection

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _joined(body: Body) -> aiohttp.BytesPayload:
    parts = body_parts(body)
    data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
    # aiohttp warns that one large write "might lock the event loop"; it is one memcpy into
    # the transport buffer, cheaper than the 64 KiB reads of the BytesIO it suggests.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return aiohttp.BytesPayload(data)


@contextlib.contextmanager
def _translate(what: str, limit: float) -> Iterator[None]:
    """aiohttp and socket errors into our family, once, at the boundary."""
    try:
        yield
    except (TimeoutError, asyncio.TimeoutError):
        raise TimedOut(f"{what} timed out after {limit}s", timeout=limit) from None
    except aiohttp.ClientConnectorCertificateError as exc:
        raise connect_error(what, exc.certificate_error) from exc
    except aiohttp.ClientSSLError as exc:  # the TLS handshake failed
        raise connect_error(what, exc.os_error) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise Unavailable(f"{what} failed: {exc}") from exc
