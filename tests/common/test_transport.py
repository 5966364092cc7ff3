"""Behaviour both transports share, over real sockets on 127.0.0.1 (port 0), in clear and
over TLS (every raw peer then speaks inside a TLS session)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import h2.events
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
from common.addresses import listen_on
from common.spec import Endpoint
from common.transport import Client, ConnectionLimits, Tls, read_messages
from common.transport.limits import LINGER_S
from tests.common.transport_fixtures import (
    BOUNDED,
    MAX_BODY,
    TOKEN,
    UPLOAD,
    RawH2,
    Service,
    make_client,
    make_server,
    open_raw,
    read_until_closed,
)
from tests.tls_fixtures import TlsFiles

pytestmark = [pytest.mark.parametrize("kind", ["h2", "http1"]),
              pytest.mark.parametrize("security", ["plain", "tls"])]


@pytest.fixture
async def service() -> Service:
    return Service()


@pytest.fixture
def tls(security: str, tls_files: TlsFiles) -> Tls | None:
    """Every test runs in clear and over TLS: what a hostile or broken peer can make a server
    do must not change when the connection is encrypted."""
    return tls_files.tls() if security == "tls" else None


@pytest.fixture
async def pair(kind: str, service: Service, tls: Tls | None) -> AsyncIterator[tuple[object, Client]]:
    server = make_server(kind, service.router(), tls=tls)
    await server.start()
    client = make_client(kind, server.port, tls=tls)
    yield server, client
    service.release_slow.set()
    await client.close()
    await server.stop()


async def _works(client: Client) -> None:
    assert await client.call("POST", "/echo", body=b"still here") == b"still here"


@pytest.mark.parametrize("size", [0, 1, 100_000, 16 * 1024 * 1024])
async def test_round_trip(kind: str, tls: Tls | None, pair: tuple[object, Client], size: int) -> None:
    _, client = pair
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    resp = await client.request("POST", "/echo?q=a%20b", body=body)
    assert (resp.status, resp.body, resp.headers["x-query"]) == (200, body, "a b")


async def test_body_as_list_of_buffers(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    _, client = pair
    parts = [b"head", memoryview(b"-middle-"), bytearray(b"tail")]
    assert await client.call("POST", "/echo", body=parts) == b"head-middle-tail"


async def test_many_concurrent_requests_on_one_client(
    kind: str, tls: Tls | None, pair: tuple[object, Client]
) -> None:
    _, client = pair
    bodies = [f"request {i}".encode() * (i % 7 + 1) for i in range(250)]
    answers = await asyncio.gather(*(client.call("POST", "/echo", body=b) for b in bodies))
    assert answers == bodies


async def test_public_route_needs_no_token(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    server, _ = pair
    anonymous = make_client(kind, server.port, tls=tls)  # type: ignore[attr-defined]
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
    kind: str, tls: Tls | None,
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


async def test_handler_error_fields_travel(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    _, client = pair
    with pytest.raises(BadRequest) as caught:
        await client.call("POST", "/bad")
    assert (caught.value.message, caught.value.fields) == ("keys out of range", {"table": 3})


@pytest.mark.parametrize("path", ["/echo-now", "/echo-later"])
async def test_handlers_may_answer_at_once_or_later(
    kind: str, tls: Tls | None, pair: tuple[object, Client], path: str
) -> None:
    _, client = pair
    for size in (0, 10, 1_000_000):  # small bodies go at once on HTTP/2, large ones not
        assert await client.call("POST", path, body=bytes(size)) == bytes(size)
    with pytest.raises(BadRequest) as caught:
        await client.call("POST", "/bad-now")
    assert (caught.value.message, caught.value.fields) == ("keys out of range", {"table": 3})
    await _works(client)


async def test_timeout_then_connection_still_works(
    kind: str, tls: Tls | None, pair: tuple[object, Client], service: Service
) -> None:
    _, client = pair
    with pytest.raises(TimedOut):
        await client.call("POST", "/slow", timeout=0.3)
    assert service.slow_started.is_set()
    await _works(client)


async def test_restart_on_same_port_client_reconnects(kind: str, tls: Tls | None, service: Service) -> None:
    server = make_server(kind, service.router(), tls=tls)
    await server.start()
    port = server.port
    client = make_client(kind, port, timeout=5.0, tls=tls)
    try:
        await _works(client)
        await server.stop()
        with pytest.raises(Unavailable):
            await client.call("POST", "/echo", body=b"nobody home")
        server = make_server(kind, service.router(), tls=tls, port=port)
        await server.start()
        await _works(client)
    finally:
        await client.close()
        await server.stop()


async def test_streaming_response_chunk_by_chunk(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    _, client = pair
    chunks = client.stream("GET", "/messages?n=50")
    async with contextlib.aclosing(read_messages(chunks)) as messages:
        got = [m async for m in messages]
    assert got == [f"message {i}".encode() * (i + 1) for i in range(50)]
    await _works(client)


async def test_streaming_error_raises(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    _, client = pair
    with pytest.raises(NotFound):
        async with contextlib.aclosing(client.stream("GET", "/nowhere")) as chunks:
            _ = [c async for c in chunks]
    await _works(client)


# -- hardening: what a hostile or broken peer can make a server do --------------------------


@contextlib.asynccontextmanager
async def _announced_upload(
    kind: str, port: int, *, token: str | None, length: int, tls: Tls | None = None
) -> AsyncIterator[int]:
    """Announce a `length`-byte POST /echo, send none of its body, and yield the status the
    server answers with (TimeoutError if it waits for the body); the connection stays open,
    silent, until the block ends."""
    if kind == "h2":
        raw = await RawH2.open(port, tls)
        try:
            stream_id = raw.request("POST", "/echo", token=token, end_stream=False,
                                    content_length=length)
            await raw.flush()
            events = await raw.events_until(
                lambda e: isinstance(e, h2.events.ResponseReceived), timeout=5.0
            )
            answer = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
            assert answer.stream_id == stream_id
            yield int(dict(answer.headers)[":status"])
        finally:
            await raw.close()
        return
    reader, writer = await open_raw(port, tls)
    try:
        auth = f"authorization: Bearer {token}\r\n" if token else ""
        writer.write(f"POST /echo HTTP/1.1\r\nhost: x\r\n{auth}content-length: {length}\r\n\r\n"
                     .encode())
        async with asyncio.timeout(5.0):
            status_line = await reader.readline()
        yield int(status_line.split()[1])
    finally:
        writer.close()


async def _status_before_body(
    kind: str, port: int, *, token: str | None, length: int, tls: Tls | None = None
) -> int:
    """The status `_announced_upload` gets, its connection closed after."""
    async with _announced_upload(kind, port, token=token, length=length, tls=tls) as status:
        return status


async def test_unauthenticated_upload_is_refused_before_its_body(
    kind: str, tls: Tls | None, pair: tuple[object, Client]
) -> None:
    server, client = pair
    port = server.port  # type: ignore[attr-defined]
    assert await _status_before_body(kind, port, token=None, length=UPLOAD, tls=tls) == 401
    assert await _status_before_body(kind, port, token="wrong", length=UPLOAD, tls=tls) == 401
    await _works(client)


async def test_a_request_without_the_token_is_answered_and_its_connection_closed(
    kind: str, tls: Tls | None, pair: tuple[object, Client]
) -> None:
    """One answer per connection without the token: what the peer sends next is not read."""
    server, client = pair
    port = server.port  # type: ignore[attr-defined]
    reader, writer = await open_raw(port, tls)
    try:
        if kind == "h2":
            raw = RawH2(reader, writer)
            raw.conn.initiate_connection()
            raw.request("GET", "/v1/health")  # public: answered, the connection stays
            await raw.flush()
            await raw.events_until(lambda e: isinstance(e, h2.events.StreamEnded))
            raw.request("POST", "/echo")
            raw.request("POST", "/echo", token=TOKEN)
            await raw.flush()
            events = await raw.events_until(lambda e: False)  # until the server hangs up
            answers = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
            assert [dict(e.headers)[":status"] for e in answers] == ["401"]
        else:
            request = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
            authorized = request.replace(b"host: x", f"host: x\r\nauthorization: Bearer {TOKEN}".encode())
            writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n" + request + authorized)
            answers = (await read_until_closed(reader)).split(b"HTTP/1.1 ")[1:]
            assert [a[:3] for a in answers] == [b"200", b"401"]
    finally:
        writer.close()
    await _works(client)


async def test_unauthenticated_requests_past_the_budget_wait_for_the_rate(
    kind: str, tls: Tls | None, service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """Health is public: past `unauthenticated_burst`, requests are served only as fast as
    `unauthenticated_rate` allows (HTTP/2 holds the connection's reading, HTTP/1.1 the
    answer)."""
    limits = ConnectionLimits(unauthenticated_rate=20.0, unauthenticated_burst=2)
    server = make_server(kind, service.router(), tls=tls, limits=limits)
    await server.start()
    client = make_client(kind, server.port, tls=tls)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(12):
            assert orjson.loads(await client.call("GET", "/v1/health")) == {"ok": True}
        # The 12th was read only once 12 - 2 tokens had refilled, less the one it spent.
        assert loop.time() - started >= (12 - 2 - 1) / 20.0
        assert any("unauthenticated_rate" in r.getMessage() for r in caplog.records)
        await _works(client)  # authenticated requests never spend the budget
    finally:
        await client.close()
        await server.stop()


async def test_declared_oversized_body_is_refused_before_it_is_sent(
    kind: str, tls: Tls | None, pair: tuple[object, Client]
) -> None:
    server, client = pair
    port = server.port  # type: ignore[attr-defined]
    assert await _status_before_body(kind, port, token=TOKEN, length=MAX_BODY + 1, tls=tls) == 413
    await _works(client)


async def test_a_refused_upload_left_hanging_does_not_hold_the_servers_stop(
    kind: str, tls: Tls | None, service: Service
) -> None:
    """An upload refused on its declared size, whose sender then sends nothing more and
    keeps the connection open: the server reads and drops its rest for at most LINGER_S, so
    `stop()` does not wait out its grace period for it (HTTP/1.1 lingered for aiohttp's
    default 10 s, and stop waited the whole grace)."""
    server = make_server(kind, service.router(), tls=tls, grace=BOUNDED)
    await server.start()
    port = server.port  # type: ignore[attr-defined]
    async with _announced_upload(kind, port, token=TOKEN, length=MAX_BODY + 1, tls=tls) as status:
        assert status == 413
        async with asyncio.timeout(LINGER_S + BOUNDED / 2):  # half the grace: not waited out
            await server.stop()


async def _held_connection(
    kind: str, port: int, token: str | None = None, tls: Tls | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection the server has accepted and served once (with `token`, if given), now
    idle."""
    reader, writer = await open_raw(port, tls)
    if kind == "h2":
        raw = RawH2(reader, writer)
        raw.conn.initiate_connection()
        raw.request("GET", "/v1/health", token=token)
        await raw.flush()
        await raw.events_until(lambda e: isinstance(e, h2.events.StreamEnded))
    else:
        auth = b"" if token is None else f"authorization: Bearer {token}\r\n".encode()
        writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n" + auth + b"\r\n")
        async with asyncio.timeout(BOUNDED):
            await reader.readuntil(b'{"ok":true}')
    return reader, writer


async def test_idle_connection_is_closed(kind: str, tls: Tls | None, service: Service) -> None:
    server = make_server(kind, service.router(), tls=tls, limits=ConnectionLimits(idle_timeout_s=0.2))
    await server.start()
    try:
        reader, writer = await _held_connection(kind, server.port, tls=tls)
        # Closed by the server (with GOAWAY on HTTP/2), not by our timeout.
        await read_until_closed(reader)
        writer.close()
        bare_reader, bare_writer = await open_raw(server.port, tls)
        await read_until_closed(bare_reader)  # one that never sent a byte goes too
        bare_writer.close()
    finally:
        await server.stop()


async def test_busy_connection_outlives_the_idle_timeout(kind: str, tls: Tls | None, service: Service) -> None:
    server = make_server(kind, service.router(), tls=tls, limits=ConnectionLimits(idle_timeout_s=0.2))
    await server.start()
    client = make_client(kind, server.port, tls=tls)
    try:
        slow = asyncio.create_task(client.call("POST", "/slow"))
        await asyncio.wait_for(service.slow_started.wait(), BOUNDED)
        await asyncio.sleep(0.6)  # the duration under test: three idle timeouts, busy
        service.release_slow.set()
        assert await slow == b"late"
    finally:
        await client.close()
        await server.stop()


async def test_connections_over_the_cap_are_closed_at_once_with_a_log_line(
    kind: str, tls: Tls | None, service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """Every slot held by a peer that has shown the token: a newcomer is closed at once."""
    server = make_server(kind, service.router(), tls=tls, limits=ConnectionLimits(max_connections=3))
    await server.start()
    held = [await _held_connection(kind, server.port, TOKEN, tls) for _ in range(3)]
    try:
        reader, writer = await open_raw(server.port, tls)
        assert await read_until_closed(reader) == b""
        writer.close()
        assert any("max_connections" in r.getMessage() for r in caplog.records)
        held.pop()[1].close()  # a slot frees once the server sees that one go
        async with asyncio.timeout(BOUNDED):
            while True:
                client = make_client(kind, server.port, tls=tls)
                try:
                    await _works(client)
                    break
                except Unavailable:
                    await asyncio.sleep(0.05)
                finally:
                    await client.close()
    finally:
        for _, writer in held:
            writer.close()
        await server.stop()


async def _bare_connections(server: object, count: int, tls: Tls | None = None) -> list[asyncio.StreamWriter]:
    """`count` connections that send nothing, once the server holds them all."""
    held = [(await open_raw(server.port, tls))[1]  # type: ignore[attr-defined]
            for _ in range(count)]
    async with asyncio.timeout(BOUNDED):
        while server.connection_count < count:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
    return held


async def test_connections_without_the_token_make_room_for_one_with_it(
    kind: str, tls: Tls | None, service: Service
) -> None:
    """The cap full of connections that never sent a byte: a newcomer with the token is
    served at once, and the oldest of them is closed to make room."""
    server = make_server(kind, service.router(), tls=tls, limits=ConnectionLimits(max_connections=4))
    await server.start()
    try:
        held = await _bare_connections(server, 4, tls)
        for _ in range(3):  # each new connection with the token takes a slot
            client = make_client(kind, server.port, tls=tls)
            await _works(client)
            await client.close()
        assert server.connection_count <= 4
    finally:
        for writer in held:
            writer.close()
        await server.stop()


async def test_connections_without_the_token_have_a_budget_of_their_own(
    kind: str, tls: Tls | None, service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    limits = ConnectionLimits(max_unauthenticated_connections=3)
    server = make_server(kind, service.router(), tls=tls, limits=limits)
    await server.start()
    caplog.set_level(logging.INFO)
    try:
        reader, writer = await open_raw(server.port, tls)
        held = [writer, *await _bare_connections(server, 3, tls)]
        assert await read_until_closed(reader) == b""  # the oldest went for the fourth
        async with asyncio.timeout(BOUNDED):  # over TLS its close lingers for the peer's close_notify
            while server.connection_count != 3:
                await asyncio.sleep(0.01)
        assert any("max_unauthenticated_connections" in r.getMessage() for r in caplog.records)
    finally:
        for writer in held:
            writer.close()
        await server.stop()


async def test_a_connection_that_never_shows_the_token_is_closed_at_its_deadline(
    kind: str, tls: Tls | None, service: Service
) -> None:
    """Public requests every 50 ms keep it busy, never idle: it still goes after
    auth_timeout_s, while a connection that showed the token stays."""
    limits = ConnectionLimits(auth_timeout_s=0.3)
    server = make_server(kind, service.router(), tls=tls, limits=limits)
    await server.start()
    client = make_client(kind, server.port, tls=tls)
    try:
        await _works(client)
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await open_raw(server.port, tls)
        closed = asyncio.create_task(read_until_closed(reader))  # what it answers, until it hangs up
        raw = RawH2(reader, writer)
        if kind == "h2":
            raw.conn.initiate_connection()
        with contextlib.suppress(ConnectionError):
            while not closed.done():
                if kind == "h2":
                    raw.request("GET", "/v1/health")
                    await raw.flush()
                else:
                    writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
                await asyncio.wait([closed], timeout=0.05)  # the pace of the requests under test
            await closed
        assert 0.3 <= loop.time() - started < BOUNDED
        writer.close()
        await _works(client)
        assert server.connection_count == 1  # the client's, never closed
    finally:
        await client.close()
        await server.stop()


async def test_a_query_parameter_given_twice_is_a_400_naming_it(
    kind: str, tls: Tls | None, pair: tuple[object, Client]
) -> None:
    """Which of two values a server keeps is its own business: trainer=0&trainer=1 streamed
    trainer 1."""
    _, client = pair
    answer = await client.request("POST", "/echo?q=a&x=1&q=b", body=b"x")
    body = orjson.loads(answer.body)
    assert answer.status == 400 and body["parameter"] == "q" and "twice" in body["message"]
    assert (await client.request("POST", "/echo?q=a&x=1", body=b"x")).headers["x-query"] == "a"


async def test_a_port_in_use_is_unavailable_naming_it(kind: str, tls: Tls | None, service: Service) -> None:
    first = make_server(kind, service.router(), tls=tls)
    await first.start()
    try:
        second = make_server(kind, service.router(), tls=tls, port=first.port)
        with pytest.raises(Unavailable, match=f"cannot listen on 127.0.0.1:{first.port}: .*another process"):
            await second.start()
    finally:
        await first.stop()


async def test_a_server_may_serve_a_socket_that_already_listens(kind: str, tls: Tls | None, service: Service) -> None:
    """A shard listens before it registers with the coordinator, and serves that socket."""
    listener = listen_on(Endpoint(host="127.0.0.1", port=0))
    port = listener.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # waits in the backlog
    server = make_server(kind, service.router(), tls=tls, sock=listener)
    await server.start()
    client = make_client(kind, port, tls=tls)
    try:
        assert server.port == port
        await _works(client)
    finally:
        writer.close()
        await client.close()
        await server.stop()


async def test_a_public_route_takes_no_body(kind: str, tls: Tls | None, pair: tuple[object, Client]) -> None:
    server, client = pair
    answer = await client.request("GET", "/v1/health", body=b"x" * 1000)
    assert answer.status == 413
    await _works(client)


BAD_BYTES = [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # a TLS ClientHello
    b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x" * 70_000 + b"\r\n\r\n",  # an oversized header
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x09\x00\x00\x00\x00\x07garbage",
]


async def test_bad_connections_log_rate_limited_lines_without_tracebacks(
    kind: str, tls: Tls | None, pair: tuple[object, Client], caplog: pytest.LogCaptureFixture
) -> None:
    server, client = pair
    caplog.set_level(logging.INFO)
    for _ in range(20):
        for bad in BAD_BYTES:
            reader, writer = await open_raw(server.port, tls)  # type: ignore[attr-defined]
            writer.write(bad)
            await read_until_closed(reader)
            writer.close()
    await _works(client)
    lines = [r for r in caplog.records if r.levelno >= logging.INFO and r.name != "asyncio"]
    assert not [r for r in caplog.records if r.exc_info], "a bad connection logged a traceback"
    # 10 lines per 10 s for each kind of event (at most 3 kinds here), not one a connection.
    assert 1 <= len([r for r in lines if "listening" not in r.getMessage()]) <= 30


async def test_upload_cut_short_logs_no_traceback(
    kind: str, tls: Tls | None, pair: tuple[object, Client], service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = pair
    port = server.port  # type: ignore[attr-defined]
    caplog.set_level(logging.DEBUG)
    for _ in range(5):  # authenticated uploads one byte short, then the peer leaves
        if kind == "h2":
            raw = await RawH2.open(port, tls)
            stream_id = raw.request("POST", "/echo", token=TOKEN, end_stream=False,
                                    content_length=1000)
            raw.conn.send_data(stream_id, bytes(999))
            await raw.flush()
            await raw.events_until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
            await raw.close()
        else:
            reader, writer = await open_raw(port, tls)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " +
                         TOKEN.encode() + b"\r\ncontent-length: 1000\r\n\r\n" + bytes(999))
            await writer.drain()
            writer.close()
    if kind == "http1":  # wait until the server has seen every peer leave
        async with asyncio.timeout(BOUNDED):
            while sum("lost mid-body" in r.getMessage() for r in caplog.records) < 5:
                await asyncio.sleep(0.01)
    await _works(client)
    assert not [r for r in caplog.records if r.exc_info], "a cut-short upload logged a traceback"
