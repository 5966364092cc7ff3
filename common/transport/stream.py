"""Length-prefixed binary messages over a byte stream (e.g. the oracle's directive stream).

A message on the wire is a u64 little-endian payload length followed by the payload.
Transports cut the stream at arbitrary points; `MessageReader` puts messages back together.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterable, AsyncIterator

from common.errors import WireError

_LEN = struct.Struct("<Q")
DEFAULT_MAX_MESSAGE_BYTES = 1 << 31


def encode_message(payload: bytes | memoryview) -> bytes:
    """One framed message: length prefix and payload in a single buffer."""
    return _LEN.pack(memoryview(payload).nbytes) + payload


class MessageReader:
    """Sans-IO reassembly: `feed` any chunk, get back the messages it completed.

    A message's payload is copied once, whatever the chunks: the pieces of an unfinished
    one wait as views of the chunks they came in (or as copies, where a chunk is a view of
    memory its owner may reuse), and are joined when the last one comes. Appending every
    chunk to one buffer and cutting messages out of it copied a message three times, and for
    the directive stream's messages of a few hundred KB cost more in the buffer's regrowth
    (each a fresh mapping, faulted in page by page) than in the copies."""

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._max = max_message_bytes
        self._header = bytearray()  # a length prefix cut by the chunk's end
        self._length: int | None = None  # of the message being read, once its prefix is in
        self._parts: list[bytes | memoryview] = []
        self._have = 0

    @property
    def at_boundary(self) -> bool:
        """True when no partial message is buffered (a clean place for the stream to end)."""
        return self._length is None and not self._header

    def feed(self, chunk: bytes | memoryview) -> list[bytes]:
        held = isinstance(chunk, bytes)  # immutable: its pieces may wait as views
        view = memoryview(chunk).cast("B")
        messages: list[bytes] = []
        while len(view):
            if self._length is None:
                view = self._read_length(view)
                if self._length is None:
                    break
            take = min(self._length - self._have, len(view))
            if take:
                self._parts.append(view[:take] if held else bytes(view[:take]))
                self._have += take
                view = view[take:]
            if self._have == self._length:
                messages.append(self._message())
        return messages

    def _read_length(self, view: memoryview) -> memoryview:
        """Take the length prefix from the front of `view` (or as much of it as is there),
        and return the rest."""
        if not self._header and len(view) >= _LEN.size:  # the prefix whole, as it mostly is
            (length,) = _LEN.unpack_from(view)
            view = view[_LEN.size:]
        else:
            need = _LEN.size - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) < _LEN.size:
                return view
            (length,) = _LEN.unpack(self._header)
            self._header.clear()
        if length > self._max:
            raise WireError(f"message of {length} bytes exceeds {self._max}", length=length)
        self._length = length
        return view

    def _message(self) -> bytes:
        parts, self._parts, self._have, self._length = self._parts, [], 0, None
        return parts[0].tobytes() if len(parts) == 1 and isinstance(parts[0], memoryview) else b"".join(parts)


async def read_messages(
    chunks: AsyncIterable[bytes], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> AsyncIterator[bytes]:
    """Yield whole messages from `chunks`; raises WireError if the stream stops mid-message."""
    reader = MessageReader(max_message_bytes=max_message_bytes)
    async for chunk in chunks:
        for message in reader.feed(chunk):
            yield message
    if not reader.at_boundary:
        raise WireError("stream ended inside a message")
