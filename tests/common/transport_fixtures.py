"""A test service for the transport tests: routes, and a running server + client pair."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

from common.errors import BadRequest
from common.transport import (
    Client,
    ConnectionLimits,
    H2Server,
    Http1Server,
    Request,
    Response,
    Router,
    StreamResponse,
    Tls,
    connect_client,
    encode_message,
)

TOKEN = "secret"
MAX_BODY = 20 * 1024 * 1024
UPLOAD = 15 * 1024 * 1024  # a body the peer announces but never sends


@dataclass(eq=False)
class Service:
    """Handlers with the hooks tests synchronise on."""

    slow_started: asyncio.Event = field(default_factory=asyncio.Event)
    slow_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release_slow: asyncio.Event = field(default_factory=asyncio.Event)

    def router(self) -> Router:
        router = Router()
        router.add("GET", "/v1/health", self.health, public=True)
        router.add("POST", "/echo", self.echo)
        router.add("POST", "/echo-now", self.echo_now)
        router.add("POST", "/echo-later", self.echo_later)
        router.add("POST", "/bad-now", self.bad_now)
        router.add("POST", "/bad", self.bad)
        router.add("POST", "/bug", self.bug)
        router.add("POST", "/slow", self.slow)
        router.add("GET", "/messages", self.messages)
        return router

    async def health(self, request: Request) -> Response:
        return Response.json({"ok": True})

    async def echo(self, request: Request) -> Response:
        return Response(body=request.body, headers={"x-query": request.query.get("q", "")})

    def echo_now(self, request: Request) -> Response:
        """A handler that answers at once (no task on HTTP/2)."""
        return Response(body=request.body)

    def echo_later(self, request: Request) -> Awaitable[Response]:
        """A plain function whose answer is an awaitable."""
        return self.echo(request)

    def bad_now(self, request: Request) -> Response:
        raise BadRequest("keys out of range", table=3)

    async def bad(self, request: Request) -> Response:
        raise BadRequest("keys out of range", table=3)

    async def bug(self, request: Request) -> Response:
        raise RuntimeError("a handler bug")

    async def slow(self, request: Request) -> Response:
        self.slow_started.set()
        try:
            await self.release_slow.wait()
        except asyncio.CancelledError:
            self.slow_cancelled.set()
            raise
        return Response(body=b"late")

    async def messages(self, request: Request) -> StreamResponse:
        count = int(request.query["n"])

        async def produce() -> AsyncIterator[bytes]:
            for i in range(count):
                yield encode_message(f"message {i}".encode() * (i + 1))

        return StreamResponse(content_type="application/x-bagpipe-messages", chunks=produce())


def make_server(
    kind: str,
    router: Router,
    *,
    port: int = 0,
    grace: float = 5.0,
    limits: ConnectionLimits = ConnectionLimits(),
    sock: socket.socket | None = None,
    tls: Tls | None = None,
) -> H2Server | Http1Server:
    cls = H2Server if kind == "h2" else Http1Server
    return cls(router, port=port, token=TOKEN, max_body_bytes=MAX_BODY, limits=limits, grace=grace,
               sock=sock, tls=tls)


def make_client(kind: str, port: int, *, timeout: float = 10.0, tls: Tls | None = None) -> Client:
    return connect_client(kind, "127.0.0.1", port, TOKEN, timeout, tls=tls)  # type: ignore[arg-type]


# -- raw peers: what a well-behaved client never sends ------------------------------------
BOUNDED = 10.0  # seconds: upper bound on waits for a condition that should come quickly


class RawH2:
    """A bare h2 client connection over a socket: frames are sent exactly as a test asks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config)
        self.reader, self.writer = reader, writer
        self.eof = False

    @classmethod
    async def open(cls, port: int, tls: Tls | None = None) -> RawH2:
        raw = cls(*await open_raw(port, tls))
        raw.conn.initiate_connection()
        await raw.flush()
        return raw

    def request(
        self, method: str, path: str, *, token: str | None = None, end_stream: bool = True,
        content_length: int | None = None,
    ) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "http"),
                   (":authority", "127.0.0.1")]
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        if content_length is not None:
            headers.append(("content-length", str(content_length)))
        self.conn.send_headers(stream_id, headers, end_stream=end_stream)
        return stream_id

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def events_until(
        self, done: Callable[[h2.events.Event], bool], timeout: float = BOUNDED
    ) -> list[h2.events.Event]:
        """Events read until one satisfies `done` or the server closes the connection."""
        seen: list[h2.events.Event] = []
        async with asyncio.timeout(timeout):
            while not self.eof:
                data = await self.reader.read(65536)
                if not data:
                    self.eof = True
                    break
                for event in self.conn.receive_data(data):
                    seen.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        self.conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    if done(event):
                        return seen
                await self.flush()
        return seen

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def open_raw(port: int, tls: Tls | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A bare connection to 127.0.0.1:`port`: plain TCP, or a TLS session (handshake done)
    with `tls`'s client context, inside which a test speaks as it would in clear."""
    if tls is None:
        return await asyncio.open_connection("127.0.0.1", port)
    return await asyncio.open_connection("127.0.0.1", port, ssl=tls.client, server_hostname="127.0.0.1")


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = BOUNDED) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    async with asyncio.timeout(timeout):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)
