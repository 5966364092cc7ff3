"""HTTP/2-only behaviour: flow-control backpressure, stream cancellation, GOAWAY, interop,
and the sans-IO connection setup (two h2 connections wired together in memory)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import string
from collections.abc import AsyncIterator

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import numpy as np
import pytest
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame

from common.errors import TimedOut, Unavailable
from common.transport import (
    ConnectionLimits,
    H2Client,
    H2Server,
    Request,
    Router,
    StreamResponse,
    run,
)
from common.transport.h2base import (
    FRAMES_PER_TURN,
    MAX_CLOSED_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_BLOCK,
    STREAM_WINDOW,
    _take,
    initiate,
    new_connection,
)
from common.transport.h2client import _ClientProtocol
from common.transport.h2server import NEWCOMER_FRAME_LIMIT, _ServerProtocol
from tests.common.transport_fixtures import (
    BOUNDED,
    TOKEN,
    UPLOAD,
    RawH2,
    Service,
    make_client,
    make_server,
    read_until_closed,
)

CHUNK = 64 * 1024


@pytest.fixture
async def service() -> Service:
    return Service()


@pytest.fixture
async def server(service: Service) -> AsyncIterator[H2Server]:
    srv = make_server("h2", service.router())
    await srv.start()
    yield srv  # type: ignore[misc]
    service.release_slow.set()
    await srv.stop()


async def _works(client: H2Client) -> None:
    assert await client.call("POST", "/echo", body=b"ok") == b"ok"


class _Producer:
    """An endless stream that records how far it was advanced and whether it was closed."""

    def __init__(self) -> None:
        self.produced = 0
        self.consumed = 0  # bytes, updated by the test's reader
        self.overrun = asyncio.Event()
        self.closed = asyncio.Event()
        self.window_filled = asyncio.Event()

    def limit(self) -> int:
        # Window credit returns as chunks are taken, one chunk may wait inside the server's
        # send loop and one may be in the reader's hands: nothing else may be in flight.
        return (self.consumed + STREAM_WINDOW) // CHUNK + 3

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.produced += 1
                if self.produced > self.limit():
                    self.overrun.set()
                if self.produced * CHUNK >= self.consumed + STREAM_WINDOW:
                    self.window_filled.set()
                yield bytes(CHUNK)
        finally:
            self.closed.set()

    async def handler(self, request: Request) -> StreamResponse:
        return StreamResponse(chunks=self.chunks())


async def _no_overrun(producer: _Producer) -> None:
    """Give a broken sender a fair chance to run ahead; the window must stop it."""
    await asyncio.wait_for(producer.window_filled.wait(), BOUNDED)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(producer.overrun.wait(), 0.3)
    assert not producer.overrun.is_set(), (producer.produced, producer.consumed)


async def test_flow_control_backpressures_the_producer() -> None:
    producer = _Producer()
    router = Router()
    router.add("GET", "/directives", producer.handler)
    srv = H2Server(router, token=TOKEN)
    await srv.start()
    client = H2Client("127.0.0.1", srv.port, token=TOKEN)
    try:
        async with contextlib.aclosing(client.stream("GET", "/directives")) as chunks:
            for target in (CHUNK, 3 * 1024 * 1024, 20 * 1024 * 1024):
                async for chunk in chunks:
                    producer.consumed += len(chunk)
                    if producer.consumed >= target:
                        break
                producer.window_filled.clear()
                await _no_overrun(producer)
        # Leaving the stream resets it: the server stops advancing and closes the producer.
        await asyncio.wait_for(producer.closed.wait(), BOUNDED)
        assert (await client.request("GET", "/elsewhere")).status == 404  # connection alive
    finally:
        await client.close()
        await srv.stop()


async def test_timeout_resets_only_its_stream(server: H2Server, service: Service) -> None:
    client = make_client("h2", server.port)
    try:
        with pytest.raises(TimedOut):
            await client.call("POST", "/slow", timeout=0.2)
        # RST_STREAM reached the server: it cancelled that handler, and nothing else.
        await asyncio.wait_for(service.slow_cancelled.wait(), BOUNDED)
        await _works(client)  # type: ignore[arg-type]
    finally:
        await client.close()


async def test_stop_fails_in_flight_with_unavailable(service: Service) -> None:
    srv = make_server("h2", service.router(), grace=0.1)
    await srv.start()
    client = make_client("h2", srv.port)
    try:
        slow = asyncio.create_task(client.call("POST", "/slow"))
        await asyncio.wait_for(service.slow_started.wait(), BOUNDED)
        await srv.stop()
        with pytest.raises(Unavailable):
            await slow
        assert service.slow_cancelled.is_set()
    finally:
        await client.close()


async def test_stop_lets_in_flight_requests_finish(service: Service) -> None:
    srv = make_server("h2", service.router(), grace=BOUNDED)
    await srv.start()
    client = make_client("h2", srv.port)
    try:
        slow = asyncio.create_task(client.call("POST", "/slow"))
        await asyncio.wait_for(service.slow_started.wait(), BOUNDED)
        stopping = asyncio.create_task(srv.stop())
        service.release_slow.set()
        assert await slow == b"late"
        await stopping
    finally:
        await client.close()


async def test_lost_connection_fails_in_flight_then_reconnects(
    server: H2Server, service: Service
) -> None:
    client = make_client("h2", server.port)
    try:
        slow = asyncio.create_task(client.call("POST", "/slow"))
        await asyncio.wait_for(service.slow_started.wait(), BOUNDED)
        await client.close()
        with pytest.raises(Unavailable):
            await slow
        await asyncio.wait_for(service.slow_cancelled.wait(), BOUNDED)  # server noticed
        await _works(client)  # type: ignore[arg-type]
    finally:
        await client.close()


async def _curl(*args: str, stdin: bytes = b"") -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/curl", "--http2-prior-knowledge", "-sS", "--max-time", "20", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate(stdin)
    return proc.returncode or 0, out


async def test_curl_speaks_h2c_to_the_server(server: H2Server) -> None:
    base = f"http://127.0.0.1:{server.port}"
    report = "%{http_code} %{http_version}"
    rc, out = await _curl("-o", "/dev/null", "-w", report, f"{base}/v1/health")
    assert (rc, out) == (0, b"200 2")
    body = bytes(range(256)) * 12_000  # 3 MiB: several 1 MiB frames and window updates
    auth = f"Authorization: Bearer {TOKEN}"
    rc, out = await _curl("-H", auth, "--data-binary", "@-", f"{base}/echo", stdin=body)
    assert (rc, out) == (0, body)


def test_runs_on_uvloop() -> None:
    async def main() -> bytes:
        srv = make_server("h2", Service().router())
        await srv.start()
        client = make_client("h2", srv.port)
        try:
            assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
            return await client.call("POST", "/echo", body=bytes(5_000_000))
        finally:
            await client.close()
            await srv.stop()

    assert run(main()) == bytes(5_000_000)


# -- sans-IO: two connections wired together in memory ------------------------------------
def _handshake() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    client, server = new_connection(client_side=True), new_connection(client_side=False)
    initiate(client)
    initiate(server)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    return client, server


def test_large_frames_may_arrive_with_the_settings_ack() -> None:
    client, server = _handshake()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(":method", "POST"), (":path", "/"), (":scheme", "http"),
                                    (":authority", "x")])
    body = bytes(3 * MAX_FRAME_SIZE)
    client.send_data(stream_id, body[:MAX_FRAME_SIZE])
    client.send_data(stream_id, body[MAX_FRAME_SIZE:2 * MAX_FRAME_SIZE], end_stream=True)
    # One read holds the client's SETTINGS ACK and two 1 MiB DATA frames: the frame limit
    # and the 16 MiB stream window must already hold on the server.
    events = server.receive_data(client.data_to_send())
    data = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert [len(e.data) for e in data] == [MAX_FRAME_SIZE, MAX_FRAME_SIZE]
    assert server.remote_settings.initial_window_size == STREAM_WINDOW


def test_received_data_frames_are_not_hex_formatted(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: DataFrame) -> str:
        raise AssertionError("a received DATA frame was formatted")

    monkeypatch.setattr(DataFrame, "_body_repr", refuse)
    client, server = _handshake()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(":method", "POST"), (":path", "/"), (":scheme", "http"),
                                    (":authority", "x")])
    client.send_data(stream_id, bytes(MAX_FRAME_SIZE), end_stream=True)
    events = server.receive_data(client.data_to_send())
    received = [e.data for e in events if isinstance(e, h2.events.DataReceived)]
    assert sum(map(len, received)) == MAX_FRAME_SIZE


_POST = [(":method", "POST"), (":path", "/"), (":scheme", "http"), (":authority", "x")]


def test_an_uncopied_payload_goes_out_as_itself_in_the_bytes_h2_would_send() -> None:
    ours, server = _handshake()
    reference, _ = _handshake()
    payload = np.arange(3_000, dtype=np.float32)  # 12,000 bytes
    view = memoryview(payload).cast("B")
    for conn in (ours, reference):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, _POST)
    ours.send_data_uncopied(stream_id, [view[:8_000]], end_stream=False)
    ours.send_data_uncopied(stream_id, [view[8_000:10_000], view[10_000:]], end_stream=True)  # one frame
    reference.send_data(stream_id, view[:8_000].tobytes())
    reference.send_data(stream_id, view[8_000:].tobytes(), end_stream=True)

    parts = ours.outbound()
    assert b"".join(parts) == reference.data_to_send()
    uncopied = [p for p in parts if isinstance(p, memoryview)]
    assert [p.nbytes for p in uncopied] == [8_000, 2_000, 2_000]
    assert all(np.shares_memory(np.asarray(p), payload) for p in uncopied)
    assert ours.local_flow_control_window(stream_id) == reference.local_flow_control_window(stream_id)
    assert ours.outbound() == []

    events = server.receive_data(b"".join(parts))
    received = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert received == view.tobytes()
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


def test_frames_are_cut_across_parts_by_the_window_not_one_a_part() -> None:
    parts = collections.deque(memoryview(b) for b in (b"head", b"0123456789", b"xy"))
    frames = [_take(parts, n) for n in (3, 9, 4)]
    assert [[bytes(v) for v in frame] for frame in frames] == [
        [b"hea"], [b"d", b"01234567"], [b"89", b"xy"]]
    assert not parts


def test_data_to_send_still_returns_everything_queued_in_order() -> None:
    client, _ = _handshake()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, _POST)
    client.send_data_uncopied(stream_id, [memoryview(b"payload")], end_stream=False)
    client.ping(b"12345678")  # a frame queued after the payload goes after it
    sent = client.data_to_send()
    assert sent.index(b"payload") < sent.index(b"12345678")
    assert client.outbound() == []


def test_received_data_frames_padded_or_not_carry_their_payload() -> None:
    client, server = _handshake()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, _POST)
    client.send_data(stream_id, b"plain")
    client.send_data(stream_id, b"padded", pad_length=7)  # h2's own parser
    client.send_data(stream_id, b"", end_stream=True)
    events = server.receive_data(client.data_to_send())
    assert [e.data for e in events if isinstance(e, h2.events.DataReceived)] == [b"plain", b"padded", b""]
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


def test_a_data_frame_on_stream_zero_is_a_protocol_error() -> None:
    _, server = _handshake()
    frame = DataFrame(1, data=b"x").serialize()
    frame = frame[:5] + bytes(4) + frame[9:]  # stream 0
    with pytest.raises(h2.exceptions.ProtocolError):
        server.receive_data(frame)


def _request_and_answer(client: h2.connection.H2Connection, server: h2.connection.H2Connection) -> None:
    """One stream, opened by the client and answered by the server, closed on both ends."""
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(":method", "GET"), (":path", "/"), (":scheme", "http"),
                                    (":authority", "x")], end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(stream_id, [(":status", "200")], end_stream=True)
    client.receive_data(server.data_to_send())


def test_a_long_lived_connection_remembers_a_bounded_number_of_closed_streams() -> None:
    # A trainer's PS connections carry a few streams every iteration for the whole run, and
    # h2 remembers how each closed stream ended (in `_closed_streams`, about 120 bytes each):
    # with h2's own bound, 2**16, each connection grew by ~0.25 MB per 1,000 iterations until
    # 7.7 MB. (Private h2 state: an h2 upgrade that moves it fails here, to be looked at again.)
    client, server = _handshake()
    for _ in range(MAX_CLOSED_STREAMS + 500):
        _request_and_answer(client, server)
    for conn in (client, server):
        assert len(conn._closed_streams) == MAX_CLOSED_STREAMS
        assert len(conn.streams) <= 1  # the last one, closed; dropped when the next one opens


# -- writes: one for many small messages ----------------------------------------------------
class _Writes:
    """A transport that keeps each write apart, to count them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.reading = True

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str) -> object:
        return None

    def close(self) -> None:
        pass


def _post(path: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "x"),
            ("authorization", f"Bearer {TOKEN}")]


def _connected(service: Service) -> tuple[_ServerProtocol, _Writes, h2.connection.H2Connection]:
    """A server protocol on a `_Writes` transport and a client past the preface."""
    proto = _ServerProtocol(H2Server(service.router(), token=TOKEN))
    transport = _Writes()
    proto.connection_made(transport)  # type: ignore[arg-type]
    client = new_connection(client_side=True)
    initiate(client)
    proto.data_received(client.data_to_send())
    client.receive_data(b"".join(transport.writes))
    transport.writes.clear()
    return proto, transport, client


async def test_answers_given_at_once_go_out_in_one_write_per_read(service: Service) -> None:
    proto, transport, client = _connected(service)
    sent = {}
    for i in range(8):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _post("/echo-now"))
        client.send_data(stream_id, b"%d" % i, end_stream=True)
        sent[stream_id] = b"%d" % i
    proto.data_received(client.data_to_send())  # eight requests in one read
    assert len(transport.writes) == 1
    assert not proto.pending()  # answered without a task
    events = client.receive_data(transport.writes[0])
    assert {e.stream_id: e.data for e in events if isinstance(e, h2.events.DataReceived)} == sent
    proto.connection_lost(None)


async def test_a_read_of_many_frames_is_handled_a_bounded_number_a_turn(service: Service) -> None:
    """200 requests in one read: `FRAMES_PER_TURN` frames are handled per turn of the loop
    (reading paused meanwhile, so other connections' reads come between), and all answered."""
    proto, transport, client = _connected(service)
    streams = set()
    for _ in range(200):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _post("/echo-now"), end_stream=True)
        streams.add(stream_id)
    proto.data_received(client.data_to_send())
    answered: set[int] = set()
    per_turn = []
    while True:
        events = client.receive_data(b"".join(transport.writes))
        transport.writes.clear()
        ended = {e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)}
        per_turn.append(len(ended))
        answered |= ended
        if transport.reading:  # resumed: nothing left over
            break
        await asyncio.sleep(0)
    assert answered == streams
    # (The first turn also handles the client's SETTINGS acknowledgement.)
    assert max(per_turn) <= FRAMES_PER_TURN and len(per_turn) == -(-201 // FRAMES_PER_TURN)
    assert transport.reading
    proto.connection_lost(None)


async def test_requests_opened_in_one_turn_go_out_in_one_write() -> None:
    proto = _ClientProtocol("test")
    transport = _Writes()
    proto.connection_made(transport)  # type: ignore[arg-type]
    server = new_connection(client_side=False)
    initiate(server)
    server.receive_data(b"".join(transport.writes))
    proto.data_received(server.data_to_send())
    transport.writes.clear()
    opened = await asyncio.gather(
        *(proto.open_stream(_post("/echo"), [b"x"], 1, streaming=False) for _ in range(4))
    )
    await asyncio.sleep(0)
    assert all(body_sent for _, _, body_sent in opened)
    assert len(transport.writes) == 1
    events = server.receive_data(transport.writes[0])
    assert len([e for e in events if isinstance(e, h2.events.StreamEnded)]) == 4
    proto.connection_lost(None)


async def test_requests_answered_at_once_keep_the_connection_from_idling(service: Service) -> None:
    server = make_server("h2", service.router(), limits=ConnectionLimits(idle_timeout_s=0.3))
    await server.start()
    client = make_client("h2", server.port)
    try:
        await client.call("POST", "/echo-now", body=b"x")
        (connection,) = server.connections
        for _ in range(20):  # a second: over three idle timeouts, never idle for one
            await asyncio.sleep(0.05)
            assert await client.call("POST", "/echo-now", body=b"x") == b"x"
        assert server.connections == {connection}
    finally:
        await client.close()
        await server.stop()


# -- hardening -----------------------------------------------------------------------------
def _goaway(events: list[h2.events.Event]) -> h2.events.ConnectionTerminated | None:
    return next((e for e in events if isinstance(e, h2.events.ConnectionTerminated)), None)


async def _rapid_reset(raw: RawH2, token: str | None) -> None:
    with contextlib.suppress(ConnectionError):  # the server may hang up mid-flood
        for _ in range(50):  # 5,000 streams: the server must give up well before
            for _ in range(100):
                stream_id = raw.request("POST", "/echo", token=token, end_stream=False,
                                        content_length=10)
                raw.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            await raw.flush()


async def test_rapid_reset_gets_goaway_enhance_your_calm(
    server: H2Server, caplog: pytest.LogCaptureFixture
) -> None:
    raw = await RawH2.open(server.port)
    try:
        await _rapid_reset(raw, TOKEN)  # a peer with the token: the reset budget stops it
        events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated))
        goaway = _goaway(events)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        await read_until_closed(raw.reader)
        assert any("max_resets" in r.getMessage() for r in caplog.records)
    finally:
        await raw.close()
    client = make_client("h2", server.port)
    try:
        await _works(client)  # type: ignore[arg-type]
    finally:
        await client.close()


async def test_streams_without_the_token_end_the_connection_at_the_first(
    server: H2Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Reset or not, a request without the token is judged on its HEADERS: the first one is
    answered 401 if it is still open, then GOAWAY; nothing after its turn is read."""
    for reset in (True, False):
        raw = await RawH2.open(server.port)
        try:
            if reset:
                await _rapid_reset(raw, None)
            else:
                raw.request("POST", "/echo", end_stream=False, content_length=UPLOAD)
                raw.request("POST", "/echo", token=TOKEN, end_stream=False, content_length=10)
                await raw.flush()
            events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated))
            goaway = _goaway(events)
            assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
            assert goaway.last_stream_id < 2 * FRAMES_PER_TURN  # what one turn reads at most
            answers = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
            assert [dict(e.headers)[":status"] for e in answers] == ([] if reset else ["401"])
            await read_until_closed(raw.reader)
        finally:
            await raw.close()
    assert sum("without the bearer token" in r.getMessage() for r in caplog.records) == 2
    client = make_client("h2", server.port)
    try:
        await _works(client)  # type: ignore[arg-type]
    finally:
        await client.close()


async def test_reset_cancels_the_streams_work(server: H2Server, service: Service) -> None:
    raw = await RawH2.open(server.port)
    try:
        stream_id = raw.request("POST", "/slow", token=TOKEN)
        await raw.flush()
        await asyncio.wait_for(service.slow_started.wait(), BOUNDED)
        raw.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await raw.flush()
        await asyncio.wait_for(service.slow_cancelled.wait(), BOUNDED)
    finally:
        await raw.close()


async def test_max_concurrent_streams_is_advertised_and_enforced(service: Service) -> None:
    srv = make_server("h2", service.router(), limits=ConnectionLimits(max_concurrent_streams=4))
    await srv.start()
    raw = await RawH2.open(srv.port)
    try:
        for _ in range(5):  # sent before the server's SETTINGS are read: h2 cannot stop us
            raw.request("POST", "/slow", token=TOKEN)
        await raw.flush()
        events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated))
        assert raw.conn.remote_settings.max_concurrent_streams == 4
        goaway = _goaway(events)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    finally:
        await raw.close()
        service.release_slow.set()
        await srv.stop()


async def test_http1_on_the_h2c_port_is_told_how_to_connect(server: H2Server) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = await read_until_closed(reader)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 505 ")
    assert b"--http2-prior-knowledge" in answer
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/curl", "-sS", "--max-time", "20", "-w", "%{http_code}",
        f"http://127.0.0.1:{server.port}/v1/health", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    assert b"h2c" in out and out.endswith(b"505")


# -- header blocks: bounded before they are buffered ----------------------------------------
async def _send_raw(raw: RawH2, *frames: bytes) -> None:
    with contextlib.suppress(ConnectionError):  # the server may hang up mid-way
        for frame in frames:
            raw.writer.write(frame)
            await raw.writer.drain()


async def test_a_header_block_past_the_bound_gets_goaway_before_its_frame_arrives(
    server: H2Server,
) -> None:
    """HEADERS without END_HEADERS, then a CONTINUATION frame announcing 1 MiB: GOAWAY
    ENHANCE_YOUR_CALM on that frame's header, while its payload is still to come (h2 alone
    buffers 64 such frames before it looks at the block)."""
    raw = await RawH2.open(server.port)
    try:
        headers = HeadersFrame(1, data=bytes(1000))  # no END_HEADERS: a block to continue
        continuation = ContinuationFrame(1, data=bytes(MAX_FRAME_SIZE)).serialize()
        await _send_raw(raw, headers.serialize(), continuation[: 64 * 1024])  # the rest never comes
        events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated),
                                        timeout=3)
        goaway = _goaway(events)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        await raw.close()
    client = make_client("h2", server.port)
    try:
        await _works(client)  # type: ignore[arg-type]
    finally:
        await client.close()


async def test_a_frame_over_the_frame_size_is_refused_on_its_header(server: H2Server) -> None:
    raw = await RawH2.open(server.port)
    try:
        stream_id = raw.request("POST", "/echo", token=TOKEN, end_stream=False)
        await raw.flush()
        oversized = DataFrame(stream_id, data=bytes(MAX_FRAME_SIZE + 1)).serialize()
        await _send_raw(raw, oversized[: 64 * 1024])
        events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated),
                                        timeout=3)
        goaway = _goaway(events)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.FRAME_SIZE_ERROR
    finally:
        await raw.close()


async def test_a_header_block_within_the_bound_may_span_continuation_frames(
    server: H2Server,
) -> None:
    raw = await RawH2.open(server.port)
    try:
        pad = "".join(random.Random(0).choices(string.ascii_letters, k=MAX_HEADER_BLOCK * 3 // 4))
        stream_id = raw.conn.get_next_available_stream_id()
        raw.conn.send_headers(stream_id, [
            (":method", "POST"), (":path", "/echo"), (":scheme", "http"), (":authority", "x"),
            ("authorization", f"Bearer {TOKEN}"), ("x-pad", pad),
        ], end_stream=True)
        sent = raw.conn.data_to_send()
        await _send_raw(raw, sent)
        # Over 16 KiB, h2's frame size before it has read our SETTINGS: a CONTINUATION follows.
        assert 16384 < len(sent) - 9 < MAX_HEADER_BLOCK
        events = await raw.events_until(lambda e: isinstance(e, h2.events.StreamEnded))
        answer = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
        assert dict(answer.headers)[":status"] == "200"
    finally:
        await raw.close()


async def test_a_closed_connection_lets_go_of_what_it_had_buffered(service: Service) -> None:
    proto, _, client = _connected(service)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, _post("/echo"))
    frame = DataFrame(stream_id, data=bytes(MAX_FRAME_SIZE)).serialize()
    proto.data_received(client.data_to_send() + frame[: len(frame) // 2])  # half a frame
    assert len(proto.conn.incoming_buffer._data) >= MAX_FRAME_SIZE // 2
    proto.connection_lost(None)
    assert len(proto.conn.incoming_buffer._data) == 0


def _extension_frame(length: int) -> bytes:
    """A frame of a type no one knows (h2 ignores it), `length` bytes long, on stream 0."""
    return length.to_bytes(3, "big") + b"\xfa\x00" + bytes(4) + bytes(length)


async def test_a_newcomer_may_send_small_frames_only_until_it_shows_the_token(
    server: H2Server,
) -> None:
    big = _extension_frame(2 * NEWCOMER_FRAME_LIMIT)
    raw = await RawH2.open(server.port)
    try:
        await _send_raw(raw, big[: NEWCOMER_FRAME_LIMIT])  # its header is enough
        events = await raw.events_until(lambda e: isinstance(e, h2.events.ConnectionTerminated),
                                        timeout=3)
        goaway = _goaway(events)
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        await raw.close()
    raw = await RawH2.open(server.port)
    try:
        raw.request("GET", "/v1/health", token=TOKEN)
        await raw.flush()
        await raw.events_until(lambda e: isinstance(e, h2.events.StreamEnded))
        await _send_raw(raw, big)
        raw.request("POST", "/echo", token=TOKEN)
        await raw.flush()
        events = await raw.events_until(lambda e: isinstance(e, h2.events.StreamEnded))
        assert _goaway(events) is None
    finally:
        await raw.close()
