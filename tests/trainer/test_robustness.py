"""A PS or oracle that is unreachable, slow or failing: retries with backoff, then a clear
error naming the peer; never a hang, never a step without its data."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.directive import Directive
from common.errors import BadRequest, TimedOut, Unavailable
from common.spec import Endpoint
from common.steps import EndOfStream, Step
from common.transport import H2Server, Response, Router, StreamResponse, encode_message
from oracle.protocol import ACKNOWLEDGE, STREAM, StreamAck, StreamRequest, add_handlers
from ps.client import PsClient
from tests.ps.conftest import DIM, TOKEN, make_server, make_service
from trainer.io_thread import IoThread
from trainer.remote import DirectiveStream


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_ps_is_named_after_retries() -> None:
    port = _dead_port()
    client = PsClient([Endpoint(host="127.0.0.1", port=port)], token=TOKEN, dim=DIM, state_width=1,
                      retries=2, backoff_s=0.01)
    try:
        with pytest.raises(Unavailable, match=rf"PS shard 0 at 127.0.0.1:{port}.*after 3 attempts"):
            await client.fetch(np.array([0], dtype=np.int64))
    finally:
        await client.close()


async def test_ps_errors_are_raised_at_once_and_waits_time_out(tmp_path: Path) -> None:
    server = make_server("h2", make_service(0, 1, tmp_path))
    await server.start()
    client = PsClient([Endpoint(host="127.0.0.1", port=server.port)], token=TOKEN, dim=DIM, state_width=1,
                      retries=3, backoff_s=5.0)  # a retry would make this test slow: none happens
    try:
        with pytest.raises(BadRequest, match="outside"):
            await client.fetch(np.array([10**6], dtype=np.int64))
        with pytest.raises(TimedOut, match="PS shard 0 .* did not reach their version"):
            await client.fetch(np.array([1], dtype=np.int64), np.array([5]), wait_s=0.1)
    finally:
        await client.close()
        await server.stop()


def _step(x: int) -> Step:
    i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    directive = Directive(
        iteration=x, trainer=0, input_slots=np.full((2, 1), x, np.int32),
        prefetch_keys=i64, prefetch_slots=i32, prefetch_min_versions=i64, prefetch_targets=i32,
        join_keys=i64, join_send_slots=i32, join_recv_slots=i32,
        sync_now_keys=i64, sync_now_slots=i32, sync_later_keys=i64, sync_later_slots=i32,
        leave_slots=i32, write_keys=i64, write_slots=i32, write_flush=np.zeros(0, np.uint8),
        checkpoint=False,
    )
    return Step(directive=directive, labels=np.full(2, x, np.float32), dense=np.zeros((2, 3), np.float32))


class FlakyOracle:
    """Streams steps 0..total-1 but breaks the first connection after `break_after` steps."""

    def __init__(self, total: int, break_after: int) -> None:
        self.total, self.break_after = total, break_after
        self.starts: list[int] = []
        self.acknowledged = 0  # the highest `next` acknowledged
        self.acks = 0
        self.refuse_acks = False

    def router(self) -> Router:
        router = Router()
        add_handlers(router, {STREAM: self.stream, ACKNOWLEDGE: self.ack})
        return router

    def ack(self, ack: StreamAck) -> Response:
        if self.refuse_acks:
            raise BadRequest("no acknowledgements here")
        self.acks += 1
        self.acknowledged = max(self.acknowledged, ack.next)
        return Response(status=204)

    async def stream(self, ask: StreamRequest) -> StreamResponse:
        start = ask.start
        self.starts.append(start)
        return StreamResponse(chunks=self._chunks(start, broken=len(self.starts) == 1))

    async def _chunks(self, start: int, broken: bool) -> AsyncIterator[bytes]:
        for x in range(start, self.total):
            if broken and x == self.break_after:
                raise RuntimeError("connection dropped")  # the server resets the stream
            step = _step(x)
            yield encode_message(step.batch.to_wire()) + encode_message(step.directive.to_wire())
        yield encode_message(EndOfStream(iterations=self.total).to_wire())


@contextmanager
def streaming(oracle: FlakyOracle, **options: Any) -> Iterator[tuple[IoThread, DirectiveStream]]:
    """Trainer 0's stream of `oracle`'s steps on an I/O thread, and that thread; all closed
    after."""
    io = IoThread()
    server = H2Server(oracle.router(), port=0, token=TOKEN)
    io.run(server.start())
    try:
        stream = DirectiveStream(io, Endpoint(host="127.0.0.1", port=server.port), token=TOKEN,
                                 transport="h2", trainer=0, **options)
        yield io, stream
        stream.close()
    finally:
        io.run(server.stop())
        io.close()


def test_a_broken_directive_stream_resumes_where_it_stopped() -> None:
    oracle = FlakyOracle(total=7, break_after=3)
    with streaming(oracle, retries=3) as (_, stream):
        steps = list(stream)
    assert [s.iteration for s in steps] == list(range(7))
    assert all(s.labels[0] == s.iteration and s.directive.input_slots[0, 0] == s.iteration for s in steps)
    assert oracle.starts == [0, 3]
    assert stream.iterations == 7


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)  # the acknowledgements travel on the I/O thread


def test_the_stream_acknowledges_what_it_received_one_request_at_a_time() -> None:
    oracle = FlakyOracle(total=200, break_after=10**6)
    with streaming(oracle) as (_, stream):
        steps = list(stream)
        _until(lambda: oracle.acknowledged == 200, "the last step was not acknowledged")
    assert len(steps) == 200
    assert 1 <= oracle.acks <= 200  # coalesced: never more than one a step


def test_acknowledgements_the_oracle_refuses_stop_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    oracle = FlakyOracle(total=20, break_after=10**6)
    oracle.refuse_acks = True
    with streaming(oracle) as (_, stream):
        steps = list(stream)
    assert len(steps) == 20  # the steps flow on
    assert sum("refused this trainer's acknowledgements" in r.getMessage() for r in caplog.records) == 1


def test_an_unreachable_oracle_stops_the_trainer_with_its_address() -> None:
    io = IoThread()
    port = _dead_port()
    try:
        stream = DirectiveStream(io, Endpoint(host="127.0.0.1", port=port), token=TOKEN,
                                 transport="h2", trainer=1, retries=1)
        with pytest.raises(Unavailable, match=f"oracle at 127.0.0.1:{port}"):
            list(stream)
        stream.close()
    finally:
        io.close()


def test_the_reader_takes_at_most_read_ahead_steps_ahead() -> None:
    """Steps beyond `read_ahead` are left unread (so flow control holds the oracle back), and
    each step taken lets the reader take one more."""
    with streaming(FlakyOracle(total=50, break_after=10**6), read_ahead=3) as (io, stream):
        deadline = time.monotonic() + 10
        while stream._ready.qsize() < 3:  # the reader filling its room
            assert time.monotonic() < deadline, "the reader took no steps"
            io.run(asyncio.sleep(0))
        for _ in range(50):  # turns of the I/O loop in which an unbounded reader would go on
            io.run(asyncio.sleep(0))
        assert stream._ready.qsize() == 3
        steps = list(stream)
    assert [s.iteration for s in steps] == list(range(50))


def test_a_trainer_that_stops_reading_leaves_no_thread_behind() -> None:
    """A trainer that fails mid-stream must be able to exit: the reader, blocked on a full
    read-ahead buffer, is cancelled with the I/O loop and no worker thread is left."""
    import threading

    before = set(threading.enumerate())
    io = IoThread()
    oracle = FlakyOracle(total=50, break_after=10**6)
    server = H2Server(oracle.router(), port=0, token=TOKEN)
    io.run(server.start())
    stream = DirectiveStream(io, Endpoint(host="127.0.0.1", port=server.port), token=TOKEN,
                             transport="h2", trainer=0, read_ahead=2)
    first = next(iter(stream))
    assert first.iteration == 0
    io.run(server.stop())
    io.close()  # as the trainer's clean-up does after an error
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], left
