"""Behaviour both transports share, over real sockets on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import pytest

from common.errors import (
    BadRequest,
    BagpipeError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    TimedOut,
    Unauthorized,
    Unavailable,
)
from common.transport import Client, read_messages
from tests.common.transport_fixtures import MAX_BODY, Service, make_client, make_server

pytestmark = pytest.mark.parametrize("kind", ["h2", "http1"])


@pytest.fixture
async def service() -> Service:
    return Service()


@pytest.fixture
async def pair(kind: str, service: Service) -> AsyncIterator[tuple[object, Client]]:
    server = make_server(kind, service.router())
    await server.start()
    client = make_client(kind, server.port)
    yield server, client
    service.release_slow.set()
    await client.close()
    await server.stop()


async def _works(client: Client) -> None:
    assert await client.call("POST", "/echo", body=b"still here") == b"still here"


@pytest.mark.parametrize("size", [0, 1, 100_000, 16 * 1024 * 1024])
async def test_round_trip(kind: str, pair: tuple[object, Client], size: int) -> None:
    _, client = pair
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    resp = await client.request("POST", "/echo?q=a%20b", body=body)
    assert (resp.status, resp.body, resp.headers["x-query"]) == (200, body, "a b")


async def test_body_as_list_of_buffers(kind: str, pair: tuple[object, Client]) -> None:
    _, client = pair
    parts = [b"head", memoryview(b"-middle-"), bytearray(b"tail")]
    assert await client.call("POST", "/echo", body=parts) == b"head-middle-tail"


async def test_many_concurrent_requests_on_one_client(
    kind: str, pair: tuple[object, Client]
) -> None:
    _, client = pair
    bodies = [f"request {i}".encode() * (i % 7 + 1) for i in range(250)]
    answers = await asyncio.gather(*(client.call("POST", "/echo", body=b) for b in bodies))
    assert answers == bodies


async def test_public_route_needs_no_token(kind: str, pair: tuple[object, Client]) -> None:
    server, _ = pair
    anonymous = make_client(kind, server.port)  # type: ignore[attr-defined]
    try:
        resp = await anonymous.request("GET", "/v1/health", headers={"authorization": ""})
        assert (resp.status, orjson.loads(resp.body)) == (200, {"ok": True})
    finally:
        await anonymous.close()


@pytest.mark.parametrize(
    ("method", "path", "size", "headers", "status", "error"),
    [
        ("POST", "/echo", 1, {"authorization": "Bearer wrong"}, 401, Unauthorized),
        ("POST", "/echo", 1, {"authorization": ""}, 401, Unauthorized),
        ("POST", "/nowhere", 0, None, 404, NotFound),
        ("GET", "/echo", 0, None, 405, MethodNotAllowed),
        ("POST", "/echo", MAX_BODY + 1, None, 413, PayloadTooLarge),
        ("POST", "/bad", 0, None, 400, BadRequest),
        ("POST", "/bug", 0, None, 500, BagpipeError),
    ],
    ids=["wrong-token", "no-token", "404", "405", "413", "400", "500"],
)
async def test_error_answers_keep_the_connection(
    kind: str,
    pair: tuple[object, Client],
    method: str,
    path: str,
    size: int,
    headers: dict[str, str] | None,
    status: int,
    error: type[BagpipeError],
) -> None:
    _, client = pair
    body = bytes(size)
    await _works(client)
    resp = await client.request(method, path, body=body, headers=headers)
    assert resp.status == status
    assert resp.headers["content-type"] == "application/json"
    assert orjson.loads(resp.body)["error"] == error.code
    with pytest.raises(error) as caught:
        await client.call(method, path, body=body, headers=headers)
    assert type(caught.value) is error
    await _works(client)


async def test_handler_error_fields_travel(kind: str, pair: tuple[object, Client]) -> None:
    _, client = pair
    with pytest.raises(BadRequest) as caught:
        await client.call("POST", "/bad")
    assert (caught.value.message, caught.value.fields) == ("keys out of range", {"table": 3})


async def test_timeout_then_connection_still_works(
    kind: str, pair: tuple[object, Client], service: Service
) -> None:
    _, client = pair
    with pytest.raises(TimedOut):
        await client.call("POST", "/slow", timeout=0.3)
    assert service.slow_started.is_set()
    await _works(client)


async def test_restart_on_same_port_client_reconnects(kind: str, service: Service) -> None:
    server = make_server(kind, service.router())
    await server.start()
    port = server.port
    client = make_client(kind, port, timeout=5.0)
    try:
        await _works(client)
        await server.stop()
        with pytest.raises(Unavailable):
            await client.call("POST", "/echo", body=b"nobody home")
        server = make_server(kind, service.router(), port=port)
        await server.start()
        await _works(client)
    finally:
        await client.close()
        await server.stop()


async def test_streaming_response_chunk_by_chunk(kind: str, pair: tuple[object, Client]) -> None:
    _, client = pair
    chunks = client.stream("GET", "/messages?n=50")
    async with contextlib.aclosing(read_messages(chunks)) as messages:
        got = [m async for m in messages]
    assert got == [f"message {i}".encode() * (i + 1) for i in range(50)]
    await _works(client)


async def test_streaming_error_raises(kind: str, pair: tuple[object, Client]) -> None:
    _, client = pair
    with pytest.raises(NotFound):
        async with contextlib.aclosing(client.stream("GET", "/nowhere")) as chunks:
            _ = [c async for c in chunks]
    await _works(client)
