from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.errors import WireError
from common.transport import MessageReader, encode_message, read_messages


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@given(st.lists(st.binary(max_size=300), max_size=12), st.lists(st.integers(0, 10_000)))
def test_reader_reassembles_any_split(messages: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_message(m) for m in messages)
    reader = MessageReader()
    out = [m for chunk in _split(stream, cuts) for m in reader.feed(chunk)]
    assert out == messages and all(type(m) is bytes for m in out)
    assert reader.at_boundary


@given(st.lists(st.binary(max_size=300), max_size=12), st.lists(st.integers(0, 10_000)))
def test_reader_copies_what_it_keeps_of_a_reused_buffer(messages: list[bytes], cuts: list[int]) -> None:
    """A transport may hand over views of one buffer it refills for every chunk: what waits
    for the rest of its message is copied, not viewed."""
    stream = b"".join(encode_message(m) for m in messages)
    reader, buffer, out = MessageReader(), bytearray(len(stream) + 1), []
    for chunk in _split(stream, cuts):
        buffer[: len(chunk)] = chunk
        out += reader.feed(memoryview(buffer)[: len(chunk)])
        buffer[:] = b"\xff" * len(buffer)  # the next read overwrites it
    assert out == messages
    assert reader.at_boundary


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_read_messages_yields_whole_messages() -> None:
    stream = encode_message(b"abc") + encode_message(b"") + encode_message(b"x" * 1000)
    parts = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    assert [m async for m in read_messages(_chunks(parts))] == [b"abc", b"", b"x" * 1000]


async def test_stream_ending_mid_message_is_an_error() -> None:
    with pytest.raises(WireError):
        _ = [m async for m in read_messages(_chunks([encode_message(b"abcdef")[:-2]]))]


def test_oversized_length_is_refused_before_buffering() -> None:
    with pytest.raises(WireError):
        MessageReader(max_message_bytes=10).feed(encode_message(b"x" * 11)[:8])
