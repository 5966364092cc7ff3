"""Light load for bench/ps_fetch.py: small fetches sent as prepared bytes, answers counted by
their framing alone, so that the shard and not the client sets the rate.

`PsClient` spends about as much CPU per request as the shard spends answering it: on a
machine with few cores, client processes set the rate they measure. Here a request is a
slice of prepared bytes (HTTP/2: a HEADERS frame whose HPACK block repeats once its headers
are indexed, and a DATA frame; HTTP/1.1: a request head and body) and an answer counts once
its framing says it is complete (END_STREAM; Content-Length); it is right if its body has
the size of the rows asked for (and, on HTTP/1.1, status 200). The requests carry what
`PsClient.fetch` sends: the same headers, token and shard incarnation.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
import time
from dataclasses import dataclass

import hpack
import numpy as np

from common.transport.h2server import PREFACE
from ps.protocol import FETCH, INCARNATION_HEADER, FetchRequest, Rows

_FRAME_HEAD = struct.Struct(">I")
DATA, HEADERS, RST_STREAM, SETTINGS, WINDOW_UPDATE = 0, 1, 3, 4, 8
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
_MAX_WINDOW = 2**31 - 1  # what a connection may receive in all is then far above a round's


@dataclass(frozen=True, kw_only=True)
class Fetches:
    """Prepared fetch requests to one shard (bodies of one size), and a right answer's size."""

    host: str
    port: int
    path: str
    token: str
    incarnation: str
    bodies: list[bytes]
    answer_bytes: int

    @classmethod
    def of_keys(
        cls, keys: list[np.ndarray], *, dim: int, state_width: int, host: str, port: int, token: str,
        incarnation: str,
    ) -> Fetches:
        """One fetch (any version) per array of `keys`, all of one length, for rows of `dim`
        and optimizer state of `state_width`."""
        n = len(keys[0])
        answer = Rows(rows=np.zeros((n, dim), np.float32), state=np.zeros((n, state_width), np.float32),
                      versions=np.zeros(n, np.int64))
        any_version = np.full(n, -1, np.int64)
        return cls(host=host, port=port, path=FETCH.path, token=token, incarnation=incarnation,
                   bodies=[FetchRequest(keys=k, min_versions=any_version).to_wire() for k in keys],
                   answer_bytes=len(answer.to_wire()))

    def h2_headers(self) -> list[tuple[str, str]]:
        return [(":method", "POST"), (":scheme", "http"), (":authority", f"{self.host}:{self.port}"),
                (":path", self.path), ("content-length", str(len(self.bodies[0]))),
                ("authorization", f"Bearer {self.token}"), (INCARNATION_HEADER, self.incarnation)]

    def http1_head(self) -> bytes:
        return (f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"authorization: Bearer {self.token}\r\n{INCARNATION_HEADER}: {self.incarnation}\r\n"
                f"content-type: application/octet-stream\r\ncontent-length: {len(self.bodies[0])}\r\n"
                "\r\n").encode()


class _Tally:
    """Answers counted over every connection of a load that runs until `stop`."""

    def __init__(self) -> None:
        self.right = self.wrong = self.outstanding = 0
        self.stop = 0.0
        self.finished: asyncio.Future[None] | None = None

    def answered(self, right: int, wrong: int) -> int:
        """Count answers that came before `stop`: as many requests are due in their place.
        Past it, none is; the load finishes once the last one outstanding is in."""
        if time.perf_counter() < self.stop:
            self.right, self.wrong = self.right + right, self.wrong + wrong
            return right + wrong
        self.outstanding -= right + wrong
        if self.outstanding == 0 and self.finished is not None and not self.finished.done():
            self.finished.set_result(None)
        return 0

    def lost(self, exc: Exception | None) -> None:
        if self.finished is not None and not self.finished.done():
            self.finished.set_exception(ConnectionError(f"connection to the shard lost: {exc}"))


class H2Requests:
    """The bytes a client sends on one h2c connection to make the prepared fetches, stream
    after stream: no h2 state, the HPACK blocks worked out once."""

    def __init__(self, fetches: Fetches) -> None:
        self._bodies = fetches.bodies
        encoder = hpack.Encoder()
        # The first block adds every header to the HPACK table; later ones only index them.
        self._first_block = encoder.encode(fetches.h2_headers())
        self._block = encoder.encode(fetches.h2_headers())
        self._stream_id = -1

    @staticmethod
    def preface() -> bytes:
        """The connection's start: the preface, SETTINGS (no push, the largest stream
        windows) and the connection window raised as far."""
        settings = struct.pack(">HIHI", 0x2, 0, 0x4, _MAX_WINDOW)
        window = _FRAME_HEAD.pack(_MAX_WINDOW - 65535)
        return PREFACE + _frame(SETTINGS, 0, 0, settings) + _frame(WINDOW_UPDATE, 0, 0, window)

    def next(self, n: int) -> tuple[bytes, range]:
        """The next `n` fetches (HEADERS and DATA frames each) and their stream ids."""
        first = self._stream_id + 2
        frames = []
        for stream_id in range(first, first + 2 * n, 2):
            block = self._first_block if stream_id == 1 else self._block
            body = self._bodies[stream_id % len(self._bodies)]
            frames += [_frame(HEADERS, END_HEADERS, stream_id, block), _frame(DATA, END_STREAM, stream_id, body)]
        self._stream_id = first + 2 * (n - 1)
        return b"".join(frames), range(first, first + 2 * n, 2)


class _H2Fetches(asyncio.Protocol):
    """One h2c connection with any number of fetches in flight."""

    def __init__(self, tally: _Tally, fetches: Fetches) -> None:
        self._tally, self._answer_bytes = tally, fetches.answer_bytes
        self._requests = H2Requests(fetches)
        self._received: dict[int, int] = {}  # open stream → its answer's body bytes so far
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]
        self._transport.write(H2Requests.preface())

    def send(self, n: int) -> None:
        frames, stream_ids = self._requests.next(n)
        for stream_id in stream_ids:
            self._received[stream_id] = 0
        self._transport.write(frames)

    def data_received(self, data: bytes) -> None:
        buffer, pos, right, wrong, replies = self._buffer + data, 0, 0, 0, []
        while len(buffer) - pos >= 9:
            length = _FRAME_HEAD.unpack_from(buffer, pos)[0] >> 8
            if len(buffer) - pos - 9 < length:
                break
            kind, flags = buffer[pos + 3], buffer[pos + 4]
            stream_id = _FRAME_HEAD.unpack_from(buffer, pos + 5)[0] & 0x7FFFFFFF
            pos += 9 + length
            if kind == SETTINGS and not flags & ACK:
                replies.append(_frame(SETTINGS, ACK, 0, b""))
            elif kind == DATA and stream_id in self._received:
                self._received[stream_id] += length
            ended = kind == RST_STREAM or (kind in (DATA, HEADERS) and flags & END_STREAM)
            if ended and (size := self._received.pop(stream_id, None)) is not None:
                if kind != RST_STREAM and size == self._answer_bytes:
                    right += 1
                else:
                    wrong += 1
        self._buffer = buffer[pos:]
        if replies:
            self._transport.write(b"".join(replies))
        if more := self._tally.answered(right, wrong):
            self.send(more)

    def connection_lost(self, exc: Exception | None) -> None:
        self._tally.lost(exc)


class _Http1Fetches(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection with one fetch in flight at a time."""

    def __init__(self, tally: _Tally, fetches: Fetches) -> None:
        self._tally, self._bodies, self._answer_bytes = tally, fetches.bodies, fetches.answer_bytes
        self._head = fetches.http1_head()
        self._sent = 0
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]

    def send(self, n: int) -> None:
        for _ in range(n):
            self._sent += 1
            self._transport.write(self._head + self._bodies[self._sent % len(self._bodies)])

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        right = wrong = 0
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end].lower()
            length = _content_length(head)
            if len(self._buffer) < end + 4 + length:
                break
            self._buffer = self._buffer[end + 4 + length:]
            if head.startswith(b"http/1.1 200 ") and length == self._answer_bytes:
                right += 1
            else:
                wrong += 1
        if more := self._tally.answered(right, wrong):
            self.send(more)

    def connection_lost(self, exc: Exception | None) -> None:
        self._tally.lost(exc)


class FetchLoad:
    """`in_flight` fetches kept outstanding on one HTTP/2 connection or as many HTTP/1.1 ones."""

    def __init__(
        self, tally: _Tally, connections: list[tuple[asyncio.BaseTransport, _H2Fetches | _Http1Fetches]],
        in_flight: int,
    ) -> None:
        self._tally, self._connections, self._in_flight = tally, connections, in_flight

    @classmethod
    async def connect(cls, kind: str, fetches: Fetches, in_flight: int, tls: ssl.SSLContext | None = None) -> FetchLoad:
        """`in_flight` fetches over `kind`, TLS with the client context `tls`."""
        loop = asyncio.get_running_loop()
        tally = _Tally()
        peer = _H2Fetches if kind == "h2" else _Http1Fetches
        secure = {} if tls is None else {"ssl": tls, "server_hostname": fetches.host}
        connections = [
            await loop.create_connection(lambda: peer(tally, fetches), fetches.host, fetches.port, **secure)
            for _ in range(1 if kind == "h2" else in_flight)
        ]
        return cls(tally, connections, in_flight)

    async def run(self, stop: float) -> tuple[int, int]:
        """Keep the fetches outstanding until `stop` (`time.perf_counter`); the answers that
        came meanwhile, (right, wrong). With `stop` passed, one fetch per slot (a warm-up)."""
        tally = self._tally
        tally.right = tally.wrong = 0
        tally.stop, tally.outstanding = stop, self._in_flight
        tally.finished = asyncio.get_running_loop().create_future()
        for _, peer in self._connections:
            peer.send(self._in_flight // len(self._connections))
        await tally.finished
        return tally.right, tally.wrong

    def close(self) -> None:
        for transport, _ in self._connections:
            transport.close()


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """An HTTP/2 frame: 24-bit length, type, flags, stream id, payload."""
    return _FRAME_HEAD.pack(len(payload) << 8 | kind) + bytes([flags]) + _FRAME_HEAD.pack(stream_id) + payload


def _content_length(head: bytes) -> int:
    """The Content-Length of a lower-cased HTTP/1.1 response head (0 without one)."""
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + len(b"\r\ncontent-length:"):end if end >= 0 else len(head)])
