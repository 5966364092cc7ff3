"""A test service for the transport tests: routes, and a running server + client pair."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import BadRequest
from common.transport import (
    Client,
    H2Server,
    Http1Server,
    Request,
    Response,
    Router,
    StreamResponse,
    connect_client,
    encode_message,
)

TOKEN = "secret"
MAX_BODY = 20 * 1024 * 1024


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
        router.add("POST", "/bad", self.bad)
        router.add("POST", "/bug", self.bug)
        router.add("POST", "/slow", self.slow)
        router.add("GET", "/messages", self.messages)
        return router

    async def health(self, request: Request) -> Response:
        return Response.json({"ok": True})

    async def echo(self, request: Request) -> Response:
        return Response(body=request.body, headers={"x-query": request.query.get("q", "")})

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
    kind: str, router: Router, *, port: int = 0, grace: float = 5.0
) -> H2Server | Http1Server:
    cls = H2Server if kind == "h2" else Http1Server
    return cls(router, port=port, token=TOKEN, max_body_bytes=MAX_BODY, grace=grace)


def make_client(kind: str, port: int, *, timeout: float = 10.0) -> Client:
    return connect_client(kind, "127.0.0.1", port, TOKEN, timeout)  # type: ignore[arg-type]
