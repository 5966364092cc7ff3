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
    """Sans-IO reassembly: `feed` any chunk, get back the messages it completed."""

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_message_bytes

    @property
    def at_boundary(self) -> bool:
        """True when no partial message is buffered (a clean place for the stream to end)."""
        return not self._buffer

    def feed(self, chunk: bytes | memoryview) -> list[bytes]:
        self._buffer += chunk
        messages: list[bytes] = []
        start = 0
        while len(self._buffer) - start >= _LEN.size:
            (length,) = _LEN.unpack_from(self._buffer, start)
            if length > self._max:
                raise WireError(f"message of {length} bytes exceeds {self._max}", length=length)
            end = start + _LEN.size + length
            if end > len(self._buffer):
                break
            messages.append(bytes(self._buffer[start + _LEN.size : end]))
            start = end
        # One deletion per chunk, not per message: bytearray prefix deletes are cheap anyway.
        del self._buffer[:start]
        return messages


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
