"""The asyncio shell both HTTP/2 ends share around a sans-IO `h2` connection.

One method reads (`data_received` → h2 events → `handle_event`), one writes (`flush`:
whatever h2 queued goes to the transport). A read handles at most `FRAMES_PER_TURN` frames;
frames beyond wait, with the socket's reading paused, for the next turn of the event loop,
so that a peer flooding small frames (a rapid-reset attack) delays every other connection
by a bounded amount of work rather than by all it sent. Writers honour the transport's
back-pressure (`pause_writing`/`resume_writing` drive `drain`) and the peer's flow-control windows
(`send_body` waits in one place, `windows_changed`). The first network error is saved and
re-raised to every waiter, so a stream never hangs on a dead connection.

Small messages cost one write for many: frames queued while handling a read go out in the
one `flush` that ends `data_received`, and `flush_soon` writes what several callers queued
in one turn of the event loop together. A small body (`fits_now`) goes as one DATA frame.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from h2.frame_buffer import FrameBuffer
from hyperframe.exceptions import InvalidDataError, InvalidFrameError, InvalidPaddingError
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from common.errors import Unavailable
from common.transport.hpack_memo import MemoDecoder, MemoEncoder

logger = logging.getLogger(__name__)

# Tuned for large binary bodies on fast links (docs/design.md#transport: 240 → 760 MB/s with these alone).
STREAM_WINDOW = 16 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
MAX_FRAME_SIZE = 1024 * 1024
MAX_CONCURRENT_STREAMS = 4096
# How many closed streams a connection remembers (h2's default is 2**16): see QuietH2Connection.
MAX_CLOSED_STREAMS = MAX_CONCURRENT_STREAMS
_DEFAULT_WINDOW = 65535
#: Frames one read handles before the connection yields to the event loop (`H2Protocol`): a
#: peer flooding small frames costs the others at most this many frames' work per turn.
FRAMES_PER_TURN = 64
#: Bodies up to this size are sent as one DATA frame without waiting (`fits_now`); larger
#: ones go frame by frame through `send_body`, which waits for the transport to drain.
SMALL_BODY = 64 * 1024
#: The most a header block (a HEADERS frame and its CONTINUATION frames) may take on the wire.
#: Ours are a few hundred bytes (a path, the token); h2 alone would buffer 64 frames of
#: MAX_FRAME_SIZE (64 MiB) before decoding, or judging, any of it (`BoundedFrameBuffer`).
MAX_HEADER_BLOCK = 32 * 1024
_FRAME_HEADER = 9
# hyperframe's frame header: length (24 bits, as 16 + 8), type, flags, stream id.
_HEADER = struct.Struct(">HBBBL")
_DATA, _END_STREAM, _PADDED = 0x0, 0x1, 0x8
_HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x1, 0x5, 0x9


def _quiet(frame_class: type[Frame]) -> type[Frame]:
    """`frame_class` with a repr that names it and its stream and formats nothing else."""

    def __repr__(self: Frame) -> str:
        return f"{frame_class.__name__}(stream_id={self.stream_id})"

    return type(frame_class.__name__, (frame_class,), {"__repr__": __repr__})


# The frames of every request and answer, and those that come with them.
_QUIET = {
    cls: _quiet(cls)
    for cls in (DataFrame, HeadersFrame, WindowUpdateFrame, SettingsFrame, RstStreamFrame)
}


class BoundedFrameBuffer(FrameBuffer):
    """h2's frame buffer judging each frame on its 9-byte header, before its payload is
    buffered: a frame over the frame size, or over `frame_limit`, and a header block that
    would grow past `MAX_HEADER_BLOCK`, end the connection at once (h2 waits for the whole
    frame, and gathers a header block of up to 64 frames, before it looks at either).

    `frame_limit` (None: the frame size) is the largest frame a peer may send yet: a server
    lowers it until the peer has shown the token (`h2server`).
    """

    def __init__(self, server: bool = False) -> None:
        super().__init__(server=server)
        self.frame_limit: int | None = None

    def __next__(self) -> Frame:
        if len(self._data) >= _FRAME_HEADER:
            self._judge(self._data)
            if self._data[3] == _DATA and not self._data[4] & _PADDED and not self._headers_buffer:
                return self._data_frame()
        # FrameBuffer reads on by calling self.__next__ again: every frame passes here.
        return super().__next__()

    def _data_frame(self) -> Frame:
        """The next frame, an unpadded DATA frame, with its payload copied once out of the
        buffer (h2 copies it twice: a slice of the buffer, then `tobytes`)."""
        try:
            frame, length = Frame.parse_frame_header(memoryview(self._data[:_FRAME_HEADER]))
        except (InvalidDataError, InvalidFrameError) as err:  # a DATA frame on stream 0
            raise h2.exceptions.ProtocolError(f"Received frame with invalid header: {err!s}") from err
        end = _FRAME_HEADER + length
        if len(self._data) < end:
            raise StopIteration
        with memoryview(self._data) as view:
            frame.data = view[_FRAME_HEADER:end].tobytes()
        frame.body_len = length
        del self._data[:end]
        return frame

    def _judge(self, head: bytearray) -> None:
        length, kind = int.from_bytes(head[:3], "big"), head[3]
        if length > self.max_frame_size:
            raise h2.exceptions.FrameTooLargeError(
                f"frame of {length} bytes over the frame size {self.max_frame_size}"
            )
        if self.frame_limit is not None and length > self.frame_limit:
            raise h2.exceptions.DenialOfServiceError(
                f"frame of {length} bytes before the token (at most {self.frame_limit})"
            )
        if kind in (_HEADERS, _PUSH_PROMISE, _CONTINUATION):
            held = sum(len(f.data) for f in self._headers_buffer) if kind == _CONTINUATION else 0
            if held + length > MAX_HEADER_BLOCK:
                raise h2.exceptions.DenialOfServiceError(
                    f"header block over {MAX_HEADER_BLOCK} bytes"
                )

    def release(self) -> None:
        """Drop whatever is buffered (the connection is gone): a peer's unfinished frames
        must not outlive it until the cyclic garbage collector finds the connection."""
        self._data = bytearray()
        self._headers_buffer = []


class QuietH2Connection(h2.connection.H2Connection):
    """`H2Connection` without h2 4.4's eager per-frame formatting, remembering fewer closed
    streams, with HPACK coders that reuse the blocks a connection repeats (`hpack_memo`).

    h2 4.4.1 `_receive_frame` runs `logger.trace("Received frame: %s", repr(frame))`: the
    `repr` is evaluated even when the logger is the no-op `DummyLogger`. A DATA frame's
    repr re-serialises and hex-encodes its whole payload (a copy plus 2 bytes of text per
    byte) before truncating it, which was about half the client CPU on large bodies; a
    HEADERS frame's hex-encodes its header block, a few percent of a small request. The
    frames received most are switched to subclasses whose repr formats nothing; h2
    dispatches frames by exact class, so each subclass is registered to the same handler.

    h2 remembers how each closed stream ended (about 120 bytes each) for its last 2**16
    streams, to answer a frame that was already in flight when the stream closed. Every PS
    fetch and write-back is a stream on a connection that lives as long as the run, so this
    was the one Python-level growth of the trainers and the PS shards over a run: about
    0.2 MB per 1,000 iterations and connection, until 7.7 MB a connection. A frame in flight
    arrives within a round trip, and at most `MAX_CONCURRENT_STREAMS` streams are open at
    once, so that many closed ones are kept; a frame for a stream forgotten already would end
    the connection (a protocol error) rather than its stream, and the caller's retry reconnects.

    Frames are judged on their headers before they are buffered (`BoundedFrameBuffer`), and
    handed to the caller one at a time (`receive_frames`), so that what it decides on one
    (a request's token) holds for the next.
    """

    MAX_CLOSED_STREAMS = MAX_CLOSED_STREAMS

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config=config)
        self.incoming_buffer: BoundedFrameBuffer = BoundedFrameBuffer(server=not config.client_side)
        # Fresh coders, before any header is coded: h2 sets only the decoder's limit so far.
        self.encoder = MemoEncoder()
        self.decoder = MemoDecoder(self.decoder.max_header_list_size)
        table = self._frame_dispatch_table
        for cls, quiet in _QUIET.items():
            table[quiet] = table[cls]
        # Output queued behind `_data_to_send`: the uncopied payloads, each after the frames
        # queued before it (`outbound`).
        self._uncopied: list[bytes | memoryview] = []

    def send_data_uncopied(self, stream_id: int, buffers: list[memoryview], *, end_stream: bool) -> None:
        """`send_data` of one DATA frame whose payload is `buffers` in turn, none of them
        copied: they go to the transport as they are (`outbound`), so they must not change
        until written.

        h2 copies a DATA frame's payload four times before it reaches the socket (the
        stream's `tobytes`, hyperframe's body and header joins, the connection's buffer and
        `data_to_send`'s `bytes`), each into a fresh allocation the size of the payload: on a
        PS shard answering 1 MB fetches that was a third of its CPU (docs/design.md#transport).
        h2 copies a memoryview but keeps any other payload as it is, needing only its length
        (flow control); `_prepare_for_sending` queues an `_Uncopied` payload's buffers behind
        the frame header it packs instead of serialising the frame."""
        self.send_data(stream_id, _Uncopied(buffers), end_stream=end_stream)

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        for frame in frames:
            payload = frame.data if isinstance(frame, DataFrame) else None
            if not isinstance(payload, _Uncopied):
                self._data_to_send += frame.serialize()
                continue
            flags = _END_STREAM if "END_STREAM" in frame.flags else 0  # never PADDED: ours
            length = len(payload)
            self._data_to_send += _HEADER.pack(length >> 8, length & 0xFF, _DATA, flags, frame.stream_id)
            self._uncopied.append(bytes(self._data_to_send))
            self._uncopied.extend(payload.buffers)
            self._data_to_send = bytearray()

    def outbound(self) -> list[bytes | memoryview]:
        """What to write to the transport next, in order (`data_to_send` as buffers: the
        payloads of `send_data_uncopied` among them, not copied)."""
        parts, self._uncopied = self._uncopied, []
        if self._data_to_send:
            parts.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        return parts

    def data_to_send(self, amount: int | None = None) -> bytes:
        if amount is not None and self._uncopied:
            raise ValueError("data_to_send(amount) with uncopied payloads queued: use outbound()")
        if not self._uncopied:
            return super().data_to_send(amount)
        return b"".join(self.outbound())

    def clear_outbound_data_buffer(self) -> None:
        super().clear_outbound_data_buffer()
        self._uncopied = []

    def receive_frames(
        self, data: bytes, limit: int, handle: Callable[[list[h2.events.Event]], bool]
    ) -> bool:
        """`receive_data` handling at most `limit` frames, each frame's events passed to
        `handle` before the next frame is read; it returns False to stop reading. The rest
        stay buffered for the next call. Returns whether frames may remain."""
        buffer = self.incoming_buffer
        if data:
            buffer.add_data(data)
        buffer.max_frame_size = self.max_inbound_frame_size
        for _ in range(limit):
            events = self._next_frame()
            if events is None or not handle(events):
                return False
        return True

    def _next_frame(self) -> list[h2.events.Event] | None:
        """The events of the next buffered frame, None if no whole frame is buffered; a
        frame that breaks the protocol queues GOAWAY and raises ProtocolError."""
        try:
            frame = next(self.incoming_buffer, None)
            return None if frame is None else self._receive_frame(frame)
        except InvalidPaddingError as exc:  # as receive_data does
            self._terminate_connection(ErrorCodes.PROTOCOL_ERROR)
            raise h2.exceptions.ProtocolError("Received frame with invalid padding.") from exc
        except h2.exceptions.ProtocolError as exc:
            self._terminate_connection(exc.error_code)
            raise

    def _receive_frame(self, frame: Any) -> list[h2.events.Event]:
        quiet = _QUIET.get(frame.__class__)
        if quiet is not None:
            frame.__class__ = quiet
        return super()._receive_frame(frame)


def new_connection(
    *, client_side: bool, max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
) -> QuietH2Connection:
    """An h2 connection with the tuned settings already in force locally; h2 refuses a peer
    that opens more than `max_concurrent_streams` at once (a connection error).

    The settings are installed as initial values rather than through `update_settings`, and
    the inbound frame limit is raised at once: otherwise the peer's 1 MiB frames can arrive
    in the same read as its SETTINGS ACK, before h2 applies the new limit, and h2 would kill
    the connection with FRAME_SIZE_ERROR (and likewise overrun the 64 KiB stream windows).
    """
    # h2's header validation and normalisation cost over a quarter of its time per small
    # request and buy us nothing: we build every header we send (names lower-case, no
    # connection headers), and a received request is judged by our own checks, which fail
    # closed (a request needs :method and :path, a route is an exact path, the token an
    # exact lower-case `authorization`); h2 still enforces content-length. Without
    # normalisation the client's `authorization` enters the HPACK table like any other
    # header, sent in full once per connection rather than with every request (and
    # Huffman-coded and decoded each time): h2c carries it in clear either way.
    config = h2.config.H2Configuration(
        client_side=client_side,
        header_encoding="utf-8",
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = QuietH2Connection(config)
    codes = h2.settings.SettingCodes
    initial = {
        codes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        codes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
        codes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
    }
    if client_side:
        initial[codes.ENABLE_PUSH] = 0
    conn.local_settings = h2.settings.Settings(client=client_side, initial_values=initial)
    conn.max_inbound_frame_size = MAX_FRAME_SIZE
    return conn


def initiate(conn: h2.connection.H2Connection) -> None:
    """Queue the connection preface: our SETTINGS and the connection window raised to 16 MiB
    (SETTINGS cannot change the connection window, only a WINDOW_UPDATE can)."""
    conn.initiate_connection()
    conn.increment_flow_control_window(CONNECTION_WINDOW - _DEFAULT_WINDOW)


class Waiters:
    """Futures woken together when something they wait for may have changed."""

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        finally:
            if future in self._futures:
                self._futures.remove(future)

    def wake(self) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            if not future.done():
                future.set_result(None)

    def fail(self, exc: BaseException) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            if not future.done():
                future.set_exception(exc)


# Events after which a blocked sender must look again: more window, or no stream left.
_WINDOW_EVENTS = (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged, h2.events.StreamReset)


class _Uncopied:
    """A DATA frame's payload as buffers sent as they are (`send_data_uncopied`); h2 needs
    only its length."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers, self.nbytes = buffers, sum(b.nbytes for b in buffers)

    def __len__(self) -> int:
        return self.nbytes


def _take(views: collections.deque[memoryview], n: int) -> list[memoryview]:
    """The first `n` bytes of `views` (byte views), taken off its front: whole views, and
    the start of the last one where it does not fit."""
    taken: list[memoryview] = []
    while n:
        view = views[0]
        if view.nbytes <= n:
            taken.append(views.popleft())
            n -= view.nbytes
        else:
            taken.append(view[:n])
            views[0] = view[n:]
            n = 0
    return taken


class StreamGone(Exception):
    """The stream was reset or closed while we were still sending on it."""


class H2Protocol(asyncio.Protocol):
    """Base protocol: subclasses implement `handle_event` and `connection_failed`."""

    def __init__(
        self, *, client_side: bool, max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    ) -> None:
        self.conn = new_connection(
            client_side=client_side, max_concurrent_streams=max_concurrent_streams
        )
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None  # first network error, re-raised to waiters
        self._write_paused = False
        self._flush_pending = False  # a flush_soon is scheduled
        self._drain_waiters = Waiters()
        self.windows_changed = Waiters()
        self._backlog = False  # frames may be waiting in h2's buffer
        self._held: asyncio.TimerHandle | None = None  # reading held back (`hold_reading`)
        self._reading_paused = False

    # -- the one reader ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.start_connection()

    def start_connection(self) -> None:
        """Send our connection preface."""
        initiate(self.conn)
        self.flush()

    def data_received(self, data: bytes) -> None:
        self._receive(data)

    def _receive(self, data: bytes = b"") -> None:
        if not self.wants_frames():
            return
        try:
            more = self.conn.receive_frames(data, FRAMES_PER_TURN, self._handle_frame)
        except h2.exceptions.ProtocolError as exc:
            self.protocol_error(exc)
            self.flush()  # h2 queued a GOAWAY naming the error
            self._fail(Unavailable(f"HTTP/2 protocol error: {exc}"))
            self.close()
            return
        self.flush()
        self._pace(more)

    def _handle_frame(self, events: list[h2.events.Event]) -> bool:
        """Handle one frame's events; whether frames are still wanted."""
        for event in events:
            if isinstance(event, _WINDOW_EVENTS):
                self.windows_changed.wake()
            self.handle_event(event)
        return self.wants_frames()

    def _pace(self, more: bool) -> None:
        """With frames left over, stop reading the socket and handle them on the next turn of
        the loop, after what the other connections sent; read again once none are left. While
        reading is held (`hold_reading`) nothing is handled: the timer resumes. A connection
        that no longer wants frames keeps its reading as it is."""
        if not self.wants_frames():
            return
        self._backlog = more
        if self._held is not None:
            return
        if self._backlog:
            self._pause_reading()
            asyncio.get_running_loop().call_soon(self._receive)
        else:
            self._resume_reading()

    def hold_reading(self, seconds: float) -> None:
        """Read and handle nothing more from this peer for `seconds` (a rate limit): what it
        sends waits in the kernel, and TCP's flow control slows it down."""
        if self._held is not None:
            self._held.cancel()
        self._pause_reading()
        self._held = asyncio.get_running_loop().call_later(seconds, self._release)

    def _release(self) -> None:
        self._held = None
        if not self.wants_frames():
            return
        if self._backlog:
            self._receive()
        else:
            self._resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        transport = self.transport
        if self._reading_paused and transport is not None and not transport.is_closing():
            self._reading_paused = False
            transport.resume_reading()

    def wants_frames(self) -> bool:
        """Whether received frames are still handled (False: dropped unread)."""
        return self.error is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(Unavailable(f"connection lost: {exc or 'closed'}"))

    def handle_event(self, event: h2.events.Event) -> None:
        raise NotImplementedError

    def protocol_error(self, exc: h2.exceptions.ProtocolError) -> None:
        """Report a peer that broke the protocol (the connection is closed next)."""
        logger.warning("HTTP/2 protocol error from peer: %s", exc)

    def connection_failed(self, error: BaseException) -> None:
        """Called once, with the first error: fail whatever the subclass keeps waiting."""
        raise NotImplementedError

    def _fail(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        if self._held is not None:  # nothing more will be read
            self._held.cancel()
            self._held = None
        self.conn.incoming_buffer.release()
        self._drain_waiters.fail(error)
        self.windows_changed.fail(error)
        self.connection_failed(error)

    # -- the one writer ------------------------------------------------------------------
    def flush(self) -> None:
        parts = self.conn.outbound()
        if parts and self.transport is not None and not self.transport.is_closing():
            if len(parts) == 1:
                self.transport.write(parts[0])
            else:
                self.transport.writelines(parts)  # one writev, payloads uncopied

    def flush_soon(self) -> None:
        """Flush once the callers the event loop runs in this turn have queued their frames:
        one write (and one read for the peer) for all of them."""
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_pending = False
        self.flush()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drain_waiters.wake()

    async def drain(self) -> None:
        if self.error is not None:
            raise self.error
        while self._write_paused:
            await self._drain_waiters.wait()

    def close(self) -> None:
        # Once only: asyncio's TLS transport, closed twice, is unhooked from its SSL protocol.
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- flow-controlled sending ----------------------------------------------------------
    def fits_now(self, stream_id: int, length: int) -> bool:
        """Whether a body of `length` bytes is small and may go on `stream_id` at once as one
        DATA frame: within the peer's windows and frame size, the transport not paused."""
        if length > SMALL_BODY or self._write_paused:
            return False
        window = self.conn.local_flow_control_window(stream_id)
        return length <= min(window, self.conn.max_outbound_frame_size)

    def send_small_body(self, stream_id: int, parts: Sequence[bytes | memoryview]) -> None:
        """Queue a body that `fits_now` as one DATA frame ending the stream (parts are joined:
        h2 copies every payload into its frame anyway)."""
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.conn.send_data(stream_id, body, end_stream=True)

    async def send_body(
        self, stream_id: int, parts: Sequence[bytes | memoryview], *, end_stream: bool
    ) -> None:
        """Send `parts` as DATA frames within the peer's windows; raises StreamGone if the
        peer resets the stream, the connection's error if it dies. The parts go to the
        socket without a copy (`send_data_uncopied`): they must not change until the stream
        has ended (a request's until its answer came, an answer's ever: ours are fresh)."""
        views = collections.deque(v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes)
        left = sum(v.nbytes for v in views)
        try:
            if end_stream and not left:
                self.conn.end_stream(stream_id)
                self.flush()
            # Frames as large as the window allows, each across as many parts as fit: one
            # frame, not one a part, for a message of a header and a few arrays.
            while left:
                n = await self._window_for(stream_id, left)
                left -= n
                self.conn.send_data_uncopied(stream_id, _take(views, n), end_stream=end_stream and not left)
                self.flush()
                await self.drain()
        except h2.exceptions.StreamClosedError as exc:
            raise StreamGone(f"stream {stream_id} closed") from exc

    async def _window_for(self, stream_id: int, wanted: int) -> int:
        while True:
            if self.error is not None:
                raise self.error
            stream = self.conn.streams.get(stream_id)
            if stream is None or stream.closed:
                raise StreamGone(f"stream {stream_id} closed")
            window = min(
                self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            )
            if window > 0:
                return min(window, wanted)
            await self.windows_changed.wait()
