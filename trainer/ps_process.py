"""The trainer's PS client in a helper process of its own (`[trainers] ps_client = "process"`):
the sockets, HTTP/2 framing, row decoding and the write-back journal of `ps.client.PsClient`
run there, off the training process's GIL (docs/design.md#the-ps-client-process).

The trainer forks the helper first thing, before it starts any thread, and talks to it over
two socket pairs of kind SOCK_SEQPACKET (one message per send, file descriptors passed with
it; messages are pickled tuples between two processes of one program):

- **rows**, the training thread's fetches and write-backs (`SharedRows`, a `RowSource`). Their
  arrays travel in shared memory that the trainer owns and lends (`SegmentPool`: memfd
  segments, sent to the helper once each): the trainer writes a fetch's keys, or a
  write-back's rows, into a segment; the helper reads them there, and writes a fetch's rows
  straight into it, so that the insert into the cache is the one copy on the trainer's side.
  The answers are read by whoever looks at a future (`done`, `result`) or sends the next
  request, in practice the training thread at each boundary: no thread of the trainer
  waits on this channel, and none wakes for it.
- **control**, from the trainer's I/O thread (asyncio): checkpoint reports, the final
  snapshot, the restart watch. A few calls a checkpoint; their answers are small.

The helper dies with the trainer (``PR_SET_PDEATHSIG``) and ignores the signals a terminal or
a launcher sends the trainer's process group: the trainer decides when it stops. If it dies
anyway, every request waiting on it fails with `Unavailable`, as a PS out of reach would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import errors
from common.errors import BagpipeError, Unavailable
from common.poll import ready

log = logging.getLogger(__name__)

#: The largest message either side sends (headers only: arrays go through shared memory).
_MESSAGE_MAX = 1 << 16
#: Free segment bytes the trainer keeps for reuse; beyond it the largest are given up.
POOL_KEEP_BYTES = 256 << 20
_SMALLEST_SEGMENT = 1 << 16
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
#: The PsClient methods the control channel may call.
_CONTROL_METHODS = frozenset({"report_checkpoint", "snapshot", "watch_restarts"})


# -- shared memory ---------------------------------------------------------------------------


@dataclass(eq=False)
class Segment:
    id: int
    size: int
    memory: mmap.mmap

    def array(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self.memory, dtype=dtype, count=count, offset=offset).reshape(shape)


def _fetch_layout(n: int, dim: int, state_width: int) -> tuple[list[tuple[str, Any, tuple[int, ...], int]], int]:
    """Where a fetch of `n` keys keeps its arrays in a segment: (name, dtype, shape, offset)."""
    parts = [("keys", np.int64, (n,)), ("min_versions", np.int64, (n,)), ("versions", np.int64, (n,)),
             ("rows", np.float32, (n, dim)), ("state", np.float32, (n, state_width))]
    return _packed(parts)


def _write_layout(n: int, dim: int, state_width: int) -> tuple[list[tuple[str, Any, tuple[int, ...], int]], int]:
    parts = [("keys", np.int64, (n,)), ("rows", np.float32, (n, dim)), ("state", np.float32, (n, state_width))]
    return _packed(parts)


def _packed(parts: list[tuple[str, Any, tuple[int, ...]]]) -> tuple[list[tuple[str, Any, tuple[int, ...], int]], int]:
    out, offset = [], 0
    for name, dtype, shape in parts:
        out.append((name, dtype, shape, offset))
        offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 8) * 8  # 8-byte aligned
    return out, offset


def _views(segment: Segment, layout: list[tuple[str, Any, tuple[int, ...], int]]) -> dict[str, np.ndarray]:
    return {name: segment.array(offset, dtype, shape) for name, dtype, shape, offset in layout}


class SegmentPool:
    """Shared-memory segments the trainer lends the helper, reused: a segment is taken for one
    request and given back once its answer has been read (a fetch's: once its rows are in
    the cache). Sizes are powers of two, the smallest free one that fits is taken, and at most
    `keep_bytes` of free ones stay; `announce(segment)` makes a new one known to the helper,
    `forget(segment)` one given up."""

    def __init__(self, announce: Callable[[Segment, int], None], forget: Callable[[Segment], None],
                 keep_bytes: int = POOL_KEEP_BYTES) -> None:
        self._announce, self._forget, self._keep_bytes = announce, forget, keep_bytes
        self._free: list[Segment] = []
        self._next_id = 0
        self.segments = 0  # made so far

    def take(self, nbytes: int) -> Segment:
        fits = [s for s in self._free if s.size >= nbytes]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._free.remove(segment)
            return segment
        size = max(_SMALLEST_SEGMENT, 1 << max(nbytes - 1, 1).bit_length())
        fd = os.memfd_create("bagpipe-rows", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            segment = Segment(id=self._next_id, size=size, memory=mmap.mmap(fd, size))
            self._next_id += 1
            self.segments += 1
            self._announce(segment, fd)
        finally:
            os.close(fd)  # the mapping and the helper's copy keep it
        return segment

    def give_back(self, segment: Segment) -> None:
        self._free.append(segment)
        while sum(s.size for s in self._free) > self._keep_bytes and len(self._free) > 1:
            largest = max(self._free, key=lambda s: s.size)
            self._free.remove(largest)
            self._forget(largest)  # unmapped once no array refers to it


# -- messages ---------------------------------------------------------------------------------


def _error_of(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    if isinstance(exc, BagpipeError):
        return type(exc).__name__, exc.message, exc.fields
    return type(exc).__name__, str(exc), {}


def _raised(name: str, message: str, fields: dict[str, Any]) -> BaseException:
    """The helper's error as the trainer would have met it with the client in its own process."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, BagpipeError):
        exc = cls.__new__(cls)
        BagpipeError.__init__(exc, message, **fields)
        if "field" in fields:
            exc.field = fields["field"]  # type: ignore[attr-defined]
        return exc
    return RuntimeError(f"in the PS client process: {name}: {message}")


def _receive(sock: socket.socket) -> bytes | None:
    """The next message on a non-blocking socket: None if none has come, b"" once the other
    side has gone."""
    try:
        return sock.recv(_MESSAGE_MAX)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _send(sock: socket.socket, message: tuple, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


# -- the trainer's side ------------------------------------------------------------------------


class RowFuture(concurrent.futures.Future):
    """A request's answer, read from the helper by whoever waits for it or asks whether it
    is done (no thread of the trainer waits on the channel by itself)."""

    def __init__(self, channel: SharedRows) -> None:
        super().__init__()
        self._channel = channel

    def done(self) -> bool:
        if not super().done():
            self._channel.poll()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        self._channel.wait(self, timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._channel.wait(self, timeout)
        return super().exception(0)


@dataclass(frozen=True)
class _Waiting:
    future: RowFuture
    segment: Segment | None
    answer: Callable[[], Any]
    keep: bool  # the segment stays lent after a success (a fetch's rows are in it)


@dataclass(frozen=True, eq=False)
class LentRows:
    """A fetch's rows, in a segment lent to the helper: valid until `SharedRows.release`."""

    rows: np.ndarray
    state: np.ndarray
    versions: np.ndarray
    segment: Segment


class SharedRows:
    """`RowSource` over the helper's PsClient: arrays in shared memory, answers read on the
    thread that looks at them. Thread-safe (the training thread uses it; a checkpoint's
    report, on the I/O thread, may ask whether a write-back is done)."""

    def __init__(self, sock: socket.socket, *, dim: int, state_width: int, wait_s: float,
                 keep_bytes: int = POOL_KEEP_BYTES) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self.dim, self.state_width, self.wait_s = dim, state_width, wait_s
        self._lock = threading.RLock()
        self._waiting: dict[int, _Waiting] = {}
        self._next_id = 0
        self._gone: BaseException | None = None
        self.pool = SegmentPool(self._announce, self._forget, keep_bytes)

    # requests ---------------------------------------------------------------------------

    def open(self, client: dict[str, Any], *, timeout: float) -> None:
        """Make the helper's PsClient (`client`: the arguments of `ps.client.PsClient`), and
        wait for it."""
        client = dict(client)
        tls = client.pop("tls", None)  # its SSL contexts do not pickle: the helper loads its own
        self._request(("open", client, None if tls is None else tls.section), None, lambda: None).result(timeout)

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> RowFuture:
        n = len(keys)
        layout, nbytes = _fetch_layout(n, self.dim, self.state_width)
        with self._lock:
            segment = self.pool.take(nbytes)
            views = _views(segment, layout)
            views["keys"][:] = keys
            views["min_versions"][:] = min_versions
            answer = LentRows(rows=views["rows"], state=views["state"], versions=views["versions"], segment=segment)
            return self._request(("fetch", segment.id, n, self.wait_s), segment, lambda: answer, keep=True)

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: bool) -> RowFuture:
        n = len(keys)
        layout, nbytes = _write_layout(n, self.dim, self.state_width)
        with self._lock:
            segment = self.pool.take(nbytes)
            views = _views(segment, layout)
            views["keys"][:] = keys
            views["rows"][:] = rows
            views["state"][:] = state
            return self._request(("write", segment.id, n, int(version), bool(flush)), segment, lambda: None)

    def release(self, fetched: LentRows) -> None:
        """`fetched`'s segment may be lent again: its rows have been copied where they go."""
        with self._lock:
            self.pool.give_back(fetched.segment)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the helper's client and let the helper exit."""
        if self._gone is None:
            with contextlib.suppress(Exception):
                self._request(("close",), None, lambda: None).result(timeout_s)

    def _request(self, message: tuple, segment: Segment | None, answer: Callable[[], Any], *,
                 keep: bool = False) -> RowFuture:
        """Send `message` (its id put second); its future's result is `answer()`. The segment
        goes back to the pool when the answer comes, unless `keep` (a fetch's: the caller
        releases it) and the request succeeded."""
        future = RowFuture(self)
        with self._lock:
            if self._gone is not None:
                if segment is not None:
                    self.pool.give_back(segment)
                future.set_exception(self._gone)
                return future
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._waiting[request_id] = _Waiting(future, segment, answer, keep)
            self._send((message[0], request_id, *message[1:]))
        return future

    def _announce(self, segment: Segment, fd: int) -> None:
        self._send(("segment", segment.id, segment.size), [fd])

    def _forget(self, segment: Segment) -> None:
        self._send(("drop", segment.id))

    def _send(self, message: tuple, fds: list[int] | None = None) -> None:
        """Send, reading answers while the helper's side of the channel is full (it may be
        waiting for room to answer)."""
        while True:
            try:
                _send(self._sock, message, fds)
                return
            except BlockingIOError:
                ready(self._sock, select.POLLIN | select.POLLOUT, 1.0)
                self._read()
            except OSError as exc:
                self._lost(exc)
                return

    # answers ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Read every answer that has come, without waiting."""
        with self._lock:
            self._read()

    def wait(self, future: RowFuture, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not concurrent.futures.Future.done(future):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise concurrent.futures.TimeoutError()
            with self._lock:
                self._read()
                if concurrent.futures.Future.done(future):
                    return
            # the socket's readiness, outside the lock: another thread may read meanwhile
            ready(self._sock, select.POLLIN, 0.5 if left is None else min(left, 0.5))

    def _read(self) -> None:
        while self._gone is None:
            try:
                data = self._sock.recv(_MESSAGE_MAX)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(exc)
                return
            if not data:
                self._lost(None)
                return
            self._answered(pickle.loads(data))

    def _answered(self, message: tuple) -> None:
        kind, request_id = message[0], message[1]
        waiting = self._waiting.pop(request_id)
        if waiting.segment is not None and not (kind == "done" and waiting.keep):
            self.pool.give_back(waiting.segment)
        if kind == "done":
            waiting.future.set_result(waiting.answer())
        else:
            waiting.future.set_exception(_raised(*message[2]))

    def _lost(self, exc: BaseException | None) -> None:
        exited = exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError))
        why = "exited" if exited else f"is out of reach ({exc})"
        self._gone = Unavailable(f"the trainer's PS client process {why}")
        waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            w.future.set_exception(self._gone)


class ControlChannel:
    """The PsClient calls a trainer makes from its I/O thread (asyncio), answered by the
    helper: `await channel.call("report_checkpoint", c, ...)`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self._waiting: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._sock.fileno(), self._read)
        request_id, self._next_id = self._next_id, self._next_id + 1
        answer = self._waiting[request_id] = loop.create_future()
        try:
            await loop.sock_sendall(self._sock, pickle.dumps(("call", request_id, method, args, kwargs)))
        except OSError as exc:
            self._waiting.pop(request_id, None)
            raise Unavailable(f"the trainer's PS client process is out of reach ({exc})") from exc
        try:
            return await answer
        except asyncio.CancelledError:
            self._waiting.pop(request_id, None)
            with contextlib.suppress(Exception):
                self._sock.send(pickle.dumps(("cancel", request_id)))
            raise

    def _read(self) -> None:
        while (data := _receive(self._sock)) is not None:
            if not data:
                assert self._loop is not None
                self._loop.remove_reader(self._sock.fileno())
                for answer in self._waiting.values():
                    if not answer.done():
                        answer.set_exception(Unavailable("the trainer's PS client process exited"))
                self._waiting.clear()
                return
            kind, request_id, value = pickle.loads(data)
            answer = self._waiting.pop(request_id, None)
            if answer is None or answer.done():
                continue  # cancelled meanwhile
            if kind == "done":
                answer.set_result(value)
            else:
                answer.set_exception(_raised(*value))


class PsProcess:
    """The helper process and both ends the trainer holds. `start()` before any thread."""

    def __init__(self, pid: int, rows: SharedRows, control: ControlChannel) -> None:
        self.pid, self.rows, self.control = pid, rows, control
        # readable once the helper exits (as launcher.zygote's ForkedProcess waits): our
        # child, so its pid is not reused before we reap it
        self._pidfd = os.pidfd_open(pid)

    @classmethod
    def start(cls, *, dim: int, state_width: int, wait_s: float) -> PsProcess:
        rows_here, rows_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control_here, control_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # What the trainer holds is never garbage-collected in the helper: a collection there
        # would run the destructors of objects whose threads did not come along (gloo's
        # groups: a segmentation fault), and touching them would copy the pages they share.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the helper
            code = 1
            try:
                rows_here.close()
                control_here.close()
                _become_helper()
                _run_helper(rows_there, control_there)
                code = 0
            except BaseException:  # noqa: BLE001 - nothing of the trainer's may run here
                log.exception("the PS client process failed")
            finally:
                os._exit(code)
        gc.unfreeze()
        rows_there.close()
        control_there.close()
        return cls(pid, SharedRows(rows_here, dim=dim, state_width=state_width, wait_s=wait_s),
                   ControlChannel(control_here))

    # What the trainer's I/O thread calls, as it would a PsClient's.
    async def report_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return await self.control.call("report_checkpoint", *args, **kwargs)

    async def snapshot(self, *args: Any, **kwargs: Any) -> Any:
        return await self.control.call("snapshot", *args, **kwargs)

    async def watch_restarts(self, *args: Any, **kwargs: Any) -> Any:
        return await self.control.call("watch_restarts", *args, **kwargs)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the helper's client, wait for it to exit (killed after `timeout_s`), and
        reap it."""
        self.rows.close(timeout_s)
        if not ready(self._pidfd, select.POLLIN, timeout_s):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reaped already
            os.waitpid(self.pid, 0)
        os.close(self._pidfd)


# -- the helper's side -------------------------------------------------------------------------


def _become_helper() -> None:
    """Die with the trainer; leave the signals of its group to it; say what this is in ps."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(_PR_SET_NAME, b"bagpipe-ps-io")
    if os.getppid() == 1:  # the trainer died before the prctl
        os._exit(1)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def _run_helper(rows: socket.socket, control: socket.socket) -> None:
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_Helper(rows, control).serve())
    finally:
        loop.close()


class _Helper:
    def __init__(self, rows: socket.socket, control: socket.socket) -> None:
        self.rows, self.control = rows, control
        for sock in (rows, control):
            sock.setblocking(False)
        self.client: Any = None
        self.segments: dict[int, Segment] = {}
        self.calls: dict[int, asyncio.Task] = {}
        self.done: asyncio.Future | None = None
        self._outbox: dict[socket.socket, list[bytes]] = {rows: [], control: []}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        loop.add_reader(self.rows.fileno(), self._read_rows)
        loop.add_reader(self.control.fileno(), self._read_control)
        await self.done
        if self.client is not None:
            await self.client.close()

    # the rows channel ---------------------------------------------------------------------

    def _read_rows(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.rows, _MESSAGE_MAX, 4)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._stop()
                return
            message = pickle.loads(data)
            kind = message[0]
            if kind == "segment":
                _, segment_id, size = message
                self.segments[segment_id] = Segment(id=segment_id, size=size, memory=mmap.mmap(fds[0], size))
                os.close(fds[0])
            elif kind == "drop":
                self.segments.pop(message[1], None)
            else:
                asyncio.get_running_loop().create_task(self._answer_rows(message))

    async def _answer_rows(self, message: tuple) -> None:
        kind, request_id = message[0], message[1]
        try:
            if kind == "open":
                from common.transport import Tls
                from ps.client import PsClient

                client, tls = message[2], message[3]
                self.client = PsClient(**client, tls=None if tls is None else Tls.load(tls))
            elif kind == "fetch":
                await self._fetch(*message[2:])
            elif kind == "write":
                await self._write(*message[2:])
            elif kind == "close":
                self._stop()
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # handed to the trainer, which raises it where it waits
            self._post(self.rows, ("failed", request_id, _error_of(exc)))
            return
        self._post(self.rows, ("done", request_id))

    async def _fetch(self, segment_id: int, n: int, wait_s: float) -> None:
        from ps.protocol import Rows

        layout, _ = _fetch_layout(n, self.client.dim, self.client.state_width)
        v = _views(self.segments[segment_id], layout)
        out = Rows(rows=v["rows"], state=v["state"], versions=v["versions"])
        await self.client.fetch(v["keys"], v["min_versions"], wait_s=wait_s, out=out)

    async def _write(self, segment_id: int, n: int, version: int, flush: bool) -> None:
        layout, _ = _write_layout(n, self.client.dim, self.client.state_width)
        v = _views(self.segments[segment_id], layout)
        # The journal keeps its own copies (`write_back` takes each shard's part), never the segment.
        await self.client.write_back(v["keys"], v["rows"], v["state"], version, flush=flush)

    # the control channel ------------------------------------------------------------------

    def _read_control(self) -> None:
        while (data := _receive(self.control)) is not None:
            if not data:
                self._stop()
                return
            message = pickle.loads(data)
            if message[0] == "cancel":
                task = self.calls.pop(message[1], None)
                if task is not None:
                    task.cancel()
                continue
            _, request_id, method, args, kwargs = message
            self.calls[request_id] = asyncio.get_running_loop().create_task(
                self._answer_call(request_id, method, args, kwargs))

    async def _answer_call(self, request_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            if method not in _CONTROL_METHODS:
                raise ValueError(f"unknown PsClient call {method!r}")
            value = await getattr(self.client, method)(*args, **kwargs)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._post(self.control, ("failed", request_id, _error_of(exc)))
            return
        finally:
            self.calls.pop(request_id, None)
        self._post(self.control, ("done", request_id, value))

    # both ---------------------------------------------------------------------------------

    def _post(self, sock: socket.socket, message: tuple) -> None:
        """Send an answer now, or once the trainer has read what fills its side."""
        box = self._outbox[sock]
        box.append(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        if len(box) == 1:
            self._flush(sock)

    def _flush(self, sock: socket.socket) -> None:
        box = self._outbox[sock]
        loop = asyncio.get_running_loop()
        while box:
            try:
                sock.send(box[0])
            except BlockingIOError:
                loop.add_writer(sock.fileno(), self._flush, sock)
                return
            except OSError:
                box.clear()
                self._stop()
                return
            box.pop(0)
        loop.remove_writer(sock.fileno())

    def _stop(self) -> None:
        if self.done is not None and not self.done.done():
            for task in self.calls.values():
                task.cancel()
            self.done.set_result(None)
