"""The trainer's network side, run on its I/O thread: PS rows and the directive stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np

from common.directive import Directive
from common.errors import BagpipeError, TimedOut, Unavailable, WireError
from common.spec import Endpoint, Transport
from common.steps import EndOfStream, EvalBatch, Step, TrainBatch, kind_of
from common.transport import Client, Tls, connect_client, read_messages
from common.transport.retry import RetryBudget
from oracle.protocol import ACKNOWLEDGE, EVAL, FINISHED, STREAM, EvalRequest, Finished, StreamAck, StreamRequest, ask
from ps.client import PsClient
from trainer.io_thread import IoThread

log = logging.getLogger(__name__)


async def _make_semaphore(size: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(size)  # created on the loop that uses it


class RemoteRows:
    """`RowSource` over a `PsClient`: each call returns a future resolved on the I/O loop."""

    def __init__(self, io: IoThread, client: PsClient, wait_s: float) -> None:
        self.io = io
        self.client = client
        self.wait_s = wait_s

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> concurrent.futures.Future:
        return self.io.submit(self.client.fetch(keys, min_versions, wait_s=self.wait_s))

    def write_back(
        self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: bool
    ) -> concurrent.futures.Future:
        return self.io.submit(self.client.write_back(keys, rows, state, version, flush=flush))

    def release(self, fetched: object) -> None:
        """Nothing to give back: a fetch's rows are arrays of their own."""


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_END = object()


class _Acknowledger:
    """Tells the oracle how far this trainer has received its stream (``POST
    /v1/stream/ack``): the oracle keeps, and plans ahead of, what a trainer has shown it
    received, never what it merely wrote to the socket. One request at a time, carrying the
    latest figure: at most one a round trip, however fast steps come. An acknowledgement
    that fails for want of the oracle is sent again (the planner may be waiting for it);
    one the oracle refuses stops them, with a warning."""

    def __init__(self, client: Client, trainer: int, endpoint: Endpoint) -> None:
        self._client, self._trainer, self._endpoint = client, trainer, endpoint
        self._wanted = self._sent = -1
        self._task: asyncio.Task[None] | None = None
        self._refused = False

    def received(self, before: int) -> None:
        """Every step before `before` has been received."""
        self._wanted = max(self._wanted, before)
        if not self._refused and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._send())
            self._task.add_done_callback(_log_failure)

    async def _send(self) -> None:
        # Backoff only: acknowledgements go on for as long as the stream (`close`), whose
        # reader reports an oracle that stays away.
        budget = RetryBudget(retries=0, window_s=0.0, first_delay_s=0.1)
        while self._wanted > self._sent:
            wanted = self._wanted
            try:
                await ask(self._client, ACKNOWLEDGE, StreamAck(trainer=self._trainer, next=wanted))
            except (Unavailable, TimedOut):
                await budget.wait()
                continue
            except BagpipeError as exc:
                log.warning("the oracle at %s refused this trainer's acknowledgements: %s",
                            self._endpoint, exc.message)
                self._refused = True
                return
            self._sent = wanted
            budget.reset()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("acknowledging the directive stream failed", exc_info=exc)


class DirectiveStream:
    """Iterates this trainer's steps from the oracle, reading ahead on the I/O thread.

    At most `read_ahead` steps are buffered here; beyond that the reader stops taking data
    and HTTP/2 flow control holds the oracle back. Each step received is acknowledged to the
    oracle (`_Acknowledger`), which plans ahead of the slowest trainer's acknowledgements.
    A broken connection is retried with backoff from the first step not yet received (at
    least `retries` times and for at least `reconnect_s`: an oracle restarted alone serves
    the same steps again), then reported as `Unavailable` naming the oracle.
    """

    def __init__(
        self,
        io: IoThread,
        endpoint: Endpoint,
        *,
        token: str,
        transport: Transport,
        trainer: int,
        start: int = 0,
        read_ahead: int = 8,
        retries: int = 5,
        reconnect_s: float = 0.0,
        timeout_s: float = 120.0,
        tls: Tls | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.trainer = trainer
        self.iterations: int | None = None
        # Steps go from the I/O thread to the trainer's through a thread-safe queue, so that
        # taking one that is ready costs no hand-off between the threads (an `asyncio.Queue`
        # read through `io.run` woke the I/O thread and waited for it on every step: 1.6 ms
        # an iteration on two busy cores). The room for `read_ahead` of them lives on the I/O
        # loop: the reader awaits it (so it stops taking data and flow control holds the
        # oracle back) and is cancelled cleanly by `close`.
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._room: asyncio.Semaphore = io.run(_make_semaphore(read_ahead))
        self._client = connect_client(transport, endpoint.host, endpoint.port, token=token, timeout=timeout_s,
                                      tls=tls)
        self._retries = retries
        self._reconnect_s = reconnect_s
        self._timeout_s = timeout_s
        self._io = io
        self._next = start  # first step not yet handed to the queue: where a retry resumes
        self._acks = _Acknowledger(self._client, trainer, endpoint)
        self._task = io.submit(self._read())

    def __iter__(self) -> Iterator[Step]:
        while True:
            item = self._ready.get()
            self._io.loop.call_soon_threadsafe(self._room.release)
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self._task.cancel()
        self._io.submit(self._shut()).result(10)

    async def _shut(self) -> None:
        self._acks.close()
        await self._client.close()

    async def _read(self) -> None:
        budget = RetryBudget(self._retries, self._reconnect_s, first_delay_s=0.2)
        failed_at = -1
        while True:
            try:
                await self._read_from(self._next)
                return
            except Unavailable as exc:
                if self._next != failed_at:  # steps came since the last break: a new outage
                    budget.reset()
                    failed_at = self._next
                if not budget.allows_retry():
                    await self._put(_Failed(self._named(exc)))
                    return
                log.warning("directive stream from %s broke (%s); resuming at %d in %.1f s",
                            self.endpoint, exc.message, self._next, budget.delay)
                await budget.wait()
            except BagpipeError as exc:
                await self._put(_Failed(self._named(exc)))
                return
            except Exception as exc:  # a bug or a malformed message: stop the trainer clearly
                await self._put(_Failed(exc))
                return

    async def _read_from(self, start: int) -> None:
        """Read steps from `start` on; returns when the stream ends."""
        target = STREAM.target(StreamRequest(trainer=self.trainer, start=start))
        chunks = self._client.stream(STREAM.method, target, timeout=self._timeout_s)
        pending: TrainBatch | None = None
        async for message in read_messages(chunks):
            kind = kind_of(message)
            if kind == TrainBatch.KIND:
                pending = TrainBatch.from_wire(message)
            elif kind == "directive":
                step = Step.of(pending, Directive.from_wire(message))
                await self._put(step)
                self._next, pending = step.iteration + 1, None
                self._acks.received(self._next)
            elif kind == EndOfStream.KIND:
                self.iterations = EndOfStream.from_wire(message).iterations
                await self._put(_END)
                return
            else:
                raise WireError(f"unknown stream message kind {kind!r}")
        raise Unavailable("directive stream closed before its end message")

    async def _put(self, item: object) -> None:
        await self._room.acquire()
        self._ready.put(item)

    def _named(self, exc: BagpipeError) -> BagpipeError:
        return type(exc)(f"oracle at {self.endpoint}: {exc.message}", **exc.fields)


@dataclass(frozen=True, kw_only=True)
class OracleLink:
    """How a trainer reaches the oracle for its one-off requests, and how long it keeps
    trying: an oracle restarted alone is back within `reconnect_s` (`RetryBudget`)."""

    endpoint: Endpoint
    token: str
    transport: Transport
    timeout_s: float
    retries: int
    reconnect_s: float
    tls: Tls | None = None

    def client(self) -> Client:
        e = self.endpoint
        return connect_client(self.transport, e.host, e.port, token=self.token, timeout=self.timeout_s, tls=self.tls)

    def budget(self) -> RetryBudget:
        return RetryBudget(self.retries, self.reconnect_s, first_delay_s=0.2)

    def named(self, what: str, exc: BagpipeError) -> BagpipeError:
        return type(exc)(f"{what} from the oracle at {self.endpoint}: {exc.message}", **exc.fields)


def eval_batches(io: IoThread, oracle: OracleLink, trainer: int) -> Iterator[EvalBatch]:
    """This trainer's share of the held-out rows from the oracle (``GET /v1/eval``), one batch
    at a time: the trainer never reads the data, and holds one batch of it at a time. A
    broken stream is read again from its start, skipping the batches already given."""
    given = 0
    budget = oracle.budget()
    while True:
        try:
            for i, batch in enumerate(_eval_stream(io, oracle, trainer)):
                if i >= given:
                    given += 1
                    yield batch
            return
        except Unavailable as exc:
            if not budget.allows_retry():
                raise oracle.named("held-out batches", exc) from None
            log.warning("held-out stream from %s broke (%s); reading it again in %.1f s",
                        oracle.endpoint, exc.message, budget.delay)
            io.run(budget.wait())


def _eval_stream(io: IoThread, oracle: OracleLink, trainer: int) -> Iterator[EvalBatch]:
    client = oracle.client()
    target = EVAL.target(EvalRequest(trainer=trainer))
    messages = read_messages(client.stream(EVAL.method, target, timeout=oracle.timeout_s))
    try:
        while True:
            try:
                message = io.run(_next(messages))
            except StopAsyncIteration:
                raise Unavailable("held-out stream closed before its end") from None
            if kind_of(message) == EndOfStream.KIND:
                return
            yield EvalBatch.from_wire(message)
    finally:
        io.run(messages.aclose())
        io.run(client.close())


async def _next(messages: AsyncIterator[bytes]) -> bytes:
    return await anext(messages)


def report_finished(io: IoThread, oracle: OracleLink, trainer: int) -> None:
    """Tell the oracle this trainer is done (``POST /v1/finished``): once all are, it stops."""

    async def call() -> None:
        budget = oracle.budget()
        client = oracle.client()
        try:
            while True:
                try:
                    await ask(client, FINISHED, Finished(trainer=trainer))
                    return
                except Unavailable as exc:
                    if not budget.allows_retry():
                        raise oracle.named("finishing", exc) from None
                    await budget.wait()
        finally:
            await client.close()

    io.run(call())
