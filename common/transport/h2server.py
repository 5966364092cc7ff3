"""HTTP/2 cleartext (prior knowledge) server over asyncio: one task per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import h2.errors
import h2.events
import h2.exceptions

from common.errors import BadRequest, PayloadTooLarge, Unavailable
from common.transport.h2base import H2Protocol, StreamGone
from common.transport.http import (
    DEFAULT_MAX_BODY_BYTES,
    Request,
    Response,
    Router,
    StreamResponse,
    TokenCheck,
    body_length,
    body_parts,
    dispatch,
    error_response,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Incoming:
    """A request being received on one stream."""

    headers: dict[str, str]
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    rejected: bool = False


class _ServerProtocol(H2Protocol):
    def __init__(self, server: H2Server) -> None:
        super().__init__(client_side=False)
        self._server = server
        self._incoming: dict[int, _Incoming] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # stream id → its request's task
        self._refusing = False

    # -- events from the reader -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server.connections.add(self)

    def connection_failed(self, error: BaseException) -> None:
        self._server.connections.discard(self)
        self._incoming.clear()
        for task in self._tasks.values():
            task.cancel()  # nobody is left to read the answers

    def handle_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request_received(event)
        elif isinstance(event, h2.events.DataReceived):
            self._data_received(event)
        elif isinstance(event, h2.events.StreamEnded):
            self._stream_ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self._incoming.pop(event.stream_id, None)
            if task := self._tasks.get(event.stream_id):
                task.cancel()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()

    def _request_received(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        if self._refusing:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        headers = dict(event.headers or [])
        self._incoming[stream_id] = incoming = _Incoming(headers=headers)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self._server.max_body_bytes:
            self._reject(stream_id, incoming)

    def _data_received(self, event: h2.events.DataReceived) -> None:
        # Unary bodies are buffered whole, so credit goes back at once.
        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        incoming = self._incoming.get(event.stream_id)
        if incoming is None or incoming.rejected:
            return
        data = event.data or b""
        incoming.size += len(data)
        if incoming.size > self._server.max_body_bytes:
            self._reject(event.stream_id, incoming)
            return
        incoming.chunks.append(data)

    def _stream_ended(self, stream_id: int) -> None:
        incoming = self._incoming.pop(stream_id, None)
        if incoming is None or incoming.rejected:
            return
        try:
            request = _build_request(incoming)
        except BadRequest as err:
            self._spawn(stream_id, self._answer(stream_id, error_response(err)))
            return
        self._spawn(stream_id, self._serve(stream_id, request))

    def _reject(self, stream_id: int, incoming: _Incoming) -> None:
        """Answer 413 now and ask the client to stop sending (RST_STREAM NO_ERROR, RFC 9113
        §8.1); the connection and its other streams carry on."""
        incoming.rejected = True
        incoming.chunks.clear()
        limit = self._server.max_body_bytes
        err = PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
        self._spawn(stream_id, self._answer(stream_id, error_response(err), stop_upload=True))

    # -- request tasks --------------------------------------------------------------------
    def _spawn(self, stream_id: int, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks[stream_id] = task
        self._server.tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(stream_id, t))

    def _task_done(self, stream_id: int, task: asyncio.Task[None]) -> None:
        self._tasks.pop(stream_id, None)
        self._server.tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("request task failed", exc_info=exc)

    async def _serve(self, stream_id: int, request: Request) -> None:
        result = await dispatch(self._server.router, self._server.auth, request)
        await self._answer(stream_id, result)

    async def _answer(
        self, stream_id: int, result: Response | StreamResponse, *, stop_upload: bool = False
    ) -> None:
        try:
            if isinstance(result, StreamResponse):
                await self._send_stream(stream_id, result)
                return
            await self._send_response(stream_id, result)
            stream = self.conn.streams.get(stream_id)
            if stop_upload and stream is not None and not stream.closed:
                self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
                self.flush()
        except (StreamGone, Unavailable, h2.exceptions.ProtocolError) as exc:
            # The client reset the stream or the connection died: nobody to answer.
            logger.debug("answer on stream %d dropped: %s", stream_id, exc)
        except Exception:
            # A malformed Response must not leave the client waiting for its timeout.
            logger.exception("sending the answer on stream %d failed", stream_id)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                self.flush()

    async def _send_response(self, stream_id: int, response: Response) -> None:
        parts = body_parts(response.body)
        length = body_length(parts)
        headers = _response_headers(response.status, response.content_type, response.headers)
        headers.append(("content-length", str(length)))
        self.conn.send_headers(stream_id, headers, end_stream=length == 0)
        self.flush()
        if length:
            await self.send_body(stream_id, parts, end_stream=True)

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

    def goaway(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close_connection()
            self.flush()
        self.close()


def _response_headers(
    status: int, content_type: str, extra: dict[str, str]
) -> list[tuple[str, str]]:
    headers = [(":status", str(status)), ("content-type", content_type)]
    headers += [(k.lower(), v) for k, v in extra.items()]
    return headers


def _build_request(incoming: _Incoming) -> Request:
    headers = incoming.headers
    method, raw_path = headers.get(":method"), headers.get(":path")
    if not method or not raw_path:
        raise BadRequest("request without :method or :path")
    url = urlsplit(raw_path)
    return Request(
        method=method,
        path=unquote(url.path),
        query=dict(parse_qsl(url.query)),
        headers={k: v for k, v in headers.items() if not k.startswith(":")},
        body=b"".join(incoming.chunks),
    )


class H2Server:
    """Serves a `Router` over h2c. `port=0` binds a free port, reported by `.port`.

    `token=None` disables the bearer check. `stop()` refuses new streams, lets in-flight
    requests finish for up to `grace` seconds, then sends GOAWAY and closes (h2 allows no
    frame after GOAWAY, so in-flight work has to finish first).
    """

    def __init__(
        self,
        router: Router,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        grace: float = 5.0,
    ) -> None:
        self.router = router
        self.auth = TokenCheck(token)
        self.max_body_bytes = max_body_bytes
        self.connections: set[_ServerProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._host, self._port, self._grace = host, port, grace
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerProtocol(self), self._host, self._port
        )
        logger.info("h2 server listening on %s:%d", self._host, self.port)

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
