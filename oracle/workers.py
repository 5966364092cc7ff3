"""Parallel planning (docs/design.md#parallel-planning): P workers, one key partition each,
their directives merged per trainer and iteration.

Worker p plans the keys of partition p (`oracle.kernels.batch.key_partition`, a hash of the
key) in its share of every trainer's cache (`oracle.config.KeyPartition`) with the very
rules of one planner (`Planner.push_parts`), and returns its part of each final directive
(`oracle.parts.IterationParts`), its slots already in its share. `ParallelPlanner` merges
the parts of each iteration and cuts them into directives. A key, its copies and its
residencies live in one partition only, so every rule holds within a partition exactly as
in one planner of every key; what changes is that capacity victims are chosen among the
partition's copies in its share of the cache, so the plan, not training, differs from P = 1.

Where the workers run is a `Pool`: `ProcessPool` (real processes; what `Planner` uses) or
`InProcessPool` (the same planners and merge in this process, for tests). Either way a
batch's work is started with `start_push` and collected with `collect` one batch later,
so that the workers plan batch z while this process merges what z - 1 made final.

Processes. Each worker is `python -m oracle.workers` with a socket to this process, over
which pickled messages go (jobs out; parts, errors, the keys held back), and two shared
memory rings (memfd, passed at start): the batches (this process writes each once, every
worker reads it) and every input's slot (each worker writes its inputs' slots of an
iteration, this process copies the whole out). A worker blocks only on its socket, so it
sees this process's death as the end of the socket and exits; it sends any error it meets
before it exits, and this process raises it (a `ConfigError` as itself). A worker that dies
fails the planner with `PlannerWorkerError`. `close` (also at `finish`, and when the planner
is collected or the process exits) stops them. The segments of a stream (oracle/live.py)
plan in one pool instead: `ProcessPool.restart` gives its workers the next segment's
planner, and only the last `close` stops them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from common.directive import Directive
from common.errors import BagpipeError, ConfigError
from oracle.config import PlannerConfig
from oracle.parts import IterationParts, assemble, merge
from oracle.planner import Planner, checked_keys
from oracle.stats import PlannerStats

log = logging.getLogger(__name__)

#: Batches in the shared ring: batch z + 3 is written once every worker has finished the
#: job of batch z + 1 (collected), hence read batch z.
_BATCH_SLOTS = 3
#: Iterations of input slots in flight: a worker writes iteration k only once this process
#: has copied iteration k - _SLOT_SLOTS out (the end of a stream makes many final at once).
_SLOT_SLOTS = 4
_HEADER = 64  # bytes before the slot ring: the count of iterations copied out, int64
_START_TIMEOUT_S = 120.0  # a worker imports numpy and numba and loads the kernels


class PlannerWorkerError(BagpipeError):
    """A planner worker process died or failed with an error other than a ConfigError."""


@dataclass(frozen=True, kw_only=True)
class Final:
    """One final iteration: every worker's parts (in partition order, without input slots)
    and every input's slot."""

    parts: tuple[IterationParts, ...]
    input_slots: np.ndarray  # int32 [B, F]


class Pool(Protocol):
    """Where the workers run. Jobs are collected in the order they were started."""

    def start_push(self, keys: np.ndarray) -> None:
        """Every worker reads the batch `keys` (int64 [B, F], checked) and plans what it can."""

    def start_finish(self) -> None:
        """Every worker plans the rest of the stream."""

    def collect(self) -> Iterator[Final]:
        """What the earliest job not yet collected made final, in iteration order, as it
        comes (to be read to its end)."""

    @property
    def keys_held(self) -> int:
        """Keys the workers hold, as of the last job collected."""

    @property
    def cpu_s(self) -> float:
        """CPU seconds the worker processes have spent planning (their start left out), as
        of the last job collected; 0 where the workers run in this process."""

    def close(self) -> None:
        """Stop the workers (idempotent)."""


class ParallelPlanner:
    """The `Planner` of P > 1 workers: checks each batch, hands it to the pool, and merges
    and assembles what the workers made final (one batch later: module docstring)."""

    def __init__(self, config: PlannerConfig, pool: Pool, stats: PlannerStats, *, owns_pool: bool = True) -> None:
        self.config = config
        self.stats = stats
        self._pool = pool
        self._owns_pool = owns_pool  # else `finish` leaves the workers to the next planner
        self._ended_cleanly = False  # `finish` returned: every job collected
        self._shape: tuple[int, int] | None = None
        self._started = 0  # jobs started and not collected
        self._finished = False

    def push(self, keys: np.ndarray) -> list[list[Directive]]:
        if self._finished:
            raise RuntimeError("push after finish")
        keys = checked_keys(self.config, keys, self._shape)
        self._shape = keys.shape
        with self._closing_on_error():
            self._pool.start_push(keys)
            self._started += 1
            return self._collect() if self._started > 1 else []

    def finish(self) -> list[list[Directive]]:
        if self._finished:
            return []
        self._finished = True
        with self._closing_on_error():
            out = self._collect() if self._started else []
            self._pool.start_finish()
            self._started += 1
            out += self._collect()
        if self._owns_pool:
            self._pool.close()
        self._ended_cleanly = True
        return out

    @property
    def keys_held(self) -> int:
        return self._pool.keys_held

    @property
    def worker_cpu_s(self) -> float:
        return self._pool.cpu_s

    def close(self) -> None:
        """Stop planning; the workers stop too, a borrowed pool's unless it has finished
        cleanly (a failure leaves its workers in no state to plan for anyone)."""
        if not self._owns_pool and self._ended_cleanly:
            return
        self._finished = True
        self._pool.close()

    def _collect(self) -> list[list[Directive]]:
        self._started -= 1
        out = []
        for final in self._pool.collect():
            parts = merge(list(final.parts), final.input_slots)
            self.stats.add(parts.stats)
            out.append(assemble(parts))
        return out

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """A failure ends the planner: its workers stop, and it plans nothing more."""
        try:
            yield
        except BaseException:
            self.close()
            raise


class InProcessPool:
    """The workers' planners in this process, run at `start_*` (an error is raised at
    `collect`, as a worker process's is): the merge and the pipelining of `ProcessPool`
    without processes."""

    def __init__(self, config: PlannerConfig) -> None:
        self._planners = [Planner(config.for_partition(p)) for p in range(config.workers)]
        self._jobs: collections.deque[list[Final] | BaseException] = collections.deque()
        self._shape: tuple[int, int] | None = None

    def start_push(self, keys: np.ndarray) -> None:
        self._shape = keys.shape
        self._run(lambda planner: planner.push_parts(keys))

    def start_finish(self) -> None:
        self._run(lambda planner: planner.finish_parts())

    def collect(self) -> Iterator[Final]:
        job = self._jobs.popleft()
        if isinstance(job, BaseException):
            raise job
        return iter(job)

    @property
    def keys_held(self) -> int:
        return sum(planner.keys_held for planner in self._planners)

    @property
    def cpu_s(self) -> float:
        return 0.0  # counted in this process's own

    def close(self) -> None:
        pass

    def _run(self, job: Any) -> None:
        try:
            made = [job(planner) for planner in self._planners]
        except Exception as error:  # noqa: BLE001 - raised at collect, as a worker's would be
            self._jobs.append(error)
            return
        finals = []
        for parts in zip(*made, strict=True):
            assert self._shape is not None
            slots = np.empty(self._shape, np.int32)
            for part in parts:
                slots.reshape(-1)[part.input_positions] = part.input_values
            finals.append(Final(parts=tuple(p.without_inputs() for p in parts), input_slots=slots))
        self._jobs.append(finals)


class ProcessPool:
    """P worker processes (module docstring)."""

    def __init__(self, config: PlannerConfig) -> None:
        self._config = config
        self._batches = os.memfd_create("bagpipe-planner-batches")
        self._slots = os.memfd_create("bagpipe-planner-slots")
        self._rings: _Rings | None = None
        self._workers: list[_Worker] = []
        self._keys_held = 0
        self._cpu_s = 0.0
        self._copied = 0  # iterations whose input slots were copied out
        self._closed = False
        self._used = False  # a job was started since the workers' planners were made
        # stops the processes if this pool is collected, or at exit, without `close`
        self._finalizer = weakref.finalize(self, _stop, self._workers, [self._batches, self._slots])
        try:
            for p in range(config.workers):
                self._workers.append(_Worker.start(config, p, self._batches, self._slots))
            for worker in self._workers:
                worker.expect_ready()
        except BaseException:
            self.close()
            raise

    def restart(self, config: PlannerConfig) -> None:
        """Give every worker a new planner for `config` (the next segment of a stream: the
        same workers, batch shape and rings), once the last one has finished; a pool that
        has run no job yet keeps the planners it started with for the same config."""
        if self._closed:
            raise PlannerWorkerError("the planner workers were stopped")
        if config.workers != len(self._workers):
            raise ValueError(f"a pool of {len(self._workers)} workers cannot plan with {config.workers}")
        if not self._used and config == self._config:
            return
        for worker in self._workers:
            worker.send(("config", config.for_partition(worker.index)))
        for worker in self._workers:
            worker.expect_ready()
        self._config, self._used = config, False
        self._keys_held, self._cpu_s = 0, 0.0

    def start_push(self, keys: np.ndarray) -> None:
        self._used = True
        if self._rings is None:
            self._rings = _Rings.create(self._batches, self._slots, keys.shape)
        rings = self._rings
        if rings.batches.shape[1:] != keys.shape:
            raise ValueError(f"batches of shape {keys.shape} in a pool of {rings.batches.shape[1:]}")
        slot = rings.batches_written % _BATCH_SLOTS
        np.copyto(rings.batches[slot], keys)
        rings.batches_written += 1
        for worker in self._workers:
            worker.send(("push", slot, keys.shape))

    def start_finish(self) -> None:
        self._used = True
        for worker in self._workers:
            worker.send(("finish",))

    def collect(self) -> Iterator[Final]:
        while True:
            replies = [worker.receive() for worker in self._workers]
            kinds = {reply[0] for reply in replies}
            if kinds == {"done"}:
                self._keys_held = sum(reply[1] for reply in replies)
                self._cpu_s = sum(reply[2] for reply in replies)
                return
            if kinds != {"part"} or len({reply[1].iteration for reply in replies}) != 1:
                raise PlannerWorkerError(f"planner workers out of step: {sorted(kinds)}")
            assert self._rings is not None
            input_slots = self._rings.slots[self._copied % _SLOT_SLOTS].copy()
            self._copied += 1
            self._rings.copied[0] = self._copied  # the workers may write that ring slot again
            yield Final(parts=tuple(reply[1] for reply in replies), input_slots=input_slots)

    @property
    def keys_held(self) -> int:
        return self._keys_held

    @property
    def cpu_s(self) -> float:
        return self._cpu_s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:  # all asked first, so that they exit together
            worker.ask_to_stop()
        for worker in self._workers:
            worker.stop()
        self._rings = None
        self._finalizer()


def _stop(workers: list[_Worker], fds: list[int]) -> None:
    """Stop every worker still running and close the rings' memory (`ProcessPool.close`)."""
    for worker in workers:
        worker.kill()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass
class _Rings:
    """The shared rings, as this process maps them."""

    batches: np.ndarray  # int64 [_BATCH_SLOTS, B, F]
    slots: np.ndarray  # int32 [_SLOT_SLOTS, B, F]
    copied: np.ndarray  # int64 [1]: iterations whose slots this process has copied out
    maps: tuple[mmap.mmap, mmap.mmap]
    batches_written: int = 0

    @classmethod
    def create(cls, batches_fd: int, slots_fd: int, shape: tuple[int, ...]) -> _Rings:
        os.ftruncate(batches_fd, _ring_bytes(shape, 8, _BATCH_SLOTS))
        os.ftruncate(slots_fd, _HEADER + _ring_bytes(shape, 4, _SLOT_SLOTS))
        return cls.map(batches_fd, slots_fd, shape)

    @classmethod
    def map(cls, batches_fd: int, slots_fd: int, shape: tuple[int, ...]) -> _Rings:
        b = mmap.mmap(batches_fd, _ring_bytes(shape, 8, _BATCH_SLOTS))
        s = mmap.mmap(slots_fd, _HEADER + _ring_bytes(shape, 4, _SLOT_SLOTS))
        return cls(
            batches=np.frombuffer(b, np.int64).reshape(_BATCH_SLOTS, *shape),
            slots=np.frombuffer(s, np.int32, offset=_HEADER).reshape(_SLOT_SLOTS, *shape),
            copied=np.frombuffer(s, np.int64, count=1),
            maps=(b, s),
        )


def _ring_bytes(shape: tuple[int, ...], itemsize: int, slots: int) -> int:
    return max(1, slots * int(np.prod(shape)) * itemsize)


class _Worker:
    """This process's end of one worker process."""

    def __init__(self, index: int, process: subprocess.Popen[bytes], connection: Connection) -> None:
        self.index = index
        self.process = process
        self.connection = connection

    @classmethod
    def start(cls, config: PlannerConfig, index: int, batches_fd: int, slots_fd: int) -> _Worker:
        ours, theirs = socket.socketpair()
        child = theirs.detach()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])  # the checkout `oracle` comes from
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "oracle.workers", str(child), str(batches_fd), str(slots_fd)],
                pass_fds=(child, batches_fd, slots_fd),
                env=env,
            )
        finally:
            os.close(child)
        worker = cls(index, process, Connection(ours.detach()))
        worker.send(("config", config.for_partition(index)))
        return worker

    def expect_ready(self) -> None:
        if not self.connection.poll(_START_TIMEOUT_S):
            raise PlannerWorkerError(f"planner worker {self.index} did not start in {_START_TIMEOUT_S:.0f} s")
        reply = self.receive()
        if reply[0] != "ready":
            raise PlannerWorkerError(f"planner worker {self.index} answered {reply[0]!r} at start")

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self.connection.send(message)
        except OSError as error:
            raise self._last_word() from error

    def receive(self) -> tuple[Any, ...]:
        """The worker's next message; its error raised here."""
        try:
            reply = self.connection.recv()
        except (EOFError, OSError) as error:
            raise self._died() from error
        if reply[0] == "error":
            raise _worker_error(self.index, *reply[1:])
        return reply

    def ask_to_stop(self) -> None:
        try:
            self.connection.send(("stop",))
        except OSError:
            pass

    def stop(self) -> None:
        """Wait for the worker (asked to stop) to exit; kill it if it does not within seconds."""
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("planner worker %d did not stop: killing it", self.index)
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.connection.close()

    def _last_word(self) -> BagpipeError:
        """Why a worker that no longer reads went away: the error it sent before it exited
        (a failing worker sends one, then exits, while jobs may still be on their way to
        it), else that it died."""
        try:
            while self.connection.poll(0):
                reply = self.connection.recv()
                if reply[0] == "error":
                    return _worker_error(self.index, *reply[1:])
        except (EOFError, OSError):
            pass
        return self._died()

    def _died(self) -> PlannerWorkerError:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return PlannerWorkerError(f"planner worker {self.index} died (exit code {code})")


def _worker_error(index: int, kind: str, field: str, message: str, trace: str) -> BagpipeError:
    if kind == "config":
        return ConfigError(field, message)
    log.error("planner worker %d failed:\n%s", index, trace)
    return PlannerWorkerError(f"planner worker {index} failed: {message}")


# --------------------------------------------------------------------------- the worker
def serve(connection: Connection, batches_fd: int, slots_fd: int) -> None:
    """A worker's life: its config, then jobs until "stop" or the end of the socket; a new
    config (the next segment of a stream) starts a new planner in the same rings."""
    config = connection.recv()[1]
    _load_kernels()
    planner = Planner(config)
    rings: _Rings | None = None
    emitted = 0  # iterations whose input slots this worker has written, every planner's
    cpu = 0.0  # CPU seconds the current planner's jobs took (not starting)
    connection.send(("ready",))
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the planner's process is gone
            return
        if message[0] == "stop":
            return
        if message[0] == "config":
            planner, cpu = Planner(message[1]), 0.0
            connection.send(("ready",))
            continue
        started = time.process_time()
        if message[0] == "push":
            _, slot, shape = message
            if rings is None:
                rings = _Rings.map(batches_fd, slots_fd, shape)
            steps: Iterator[list[IterationParts]] = iter([planner.push_parts(rings.batches[slot])])
        else:  # sent as each iteration is planned, so that this process merges meanwhile
            steps = planner.finishing()
        for made in steps:
            for parts in made:
                assert rings is not None
                if not _wait_for_room(connection, rings, emitted):
                    return
                rings.slots[emitted % _SLOT_SLOTS].reshape(-1)[parts.input_positions] = parts.input_values
                emitted += 1
                connection.send(("part", parts.without_inputs()))
        cpu += time.process_time() - started
        connection.send(("done", planner.keys_held, cpu))


def _load_kernels() -> None:
    """Plan a made-up stream as a key partition, so that numba loads (from its cache) every
    kernel a worker calls before the worker says it is ready, not at the first batch."""
    config = PlannerConfig(
        num_trainers=2, lookahead=2, prefetch_lead=1, capacity=12, checkpoint_every=2, workers=2
    ).for_partition(0)
    planner = Planner(config)
    rng = np.random.default_rng(0)
    for _ in range(6):
        planner.push_parts(rng.integers(0, 32, size=(4, 2)))
    planner.finish_parts()


def _wait_for_room(connection: Connection, rings: _Rings, emitted: int) -> bool:
    """Wait until the ring slot of iteration `emitted` may be written; False if the planner
    went away or asked to stop meanwhile."""
    while emitted - int(rings.copied[0]) >= _SLOT_SLOTS:
        if connection.poll(0.001):
            try:
                message = connection.recv()
            except EOFError:
                return False
            if message[0] == "stop":
                return False
            raise RuntimeError(f"unexpected {message[0]!r} while the slot ring is full")
    return True


def main(argv: list[str]) -> int:
    control, batches_fd, slots_fd = (int(a) for a in argv[1:4])
    connection = Connection(control)
    try:
        serve(connection, batches_fd, slots_fd)
    except ConfigError as error:
        _send_error(connection, "config", error.field, error.message.removeprefix(f"{error.field}: "))
        return 1
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the planner
        _send_error(connection, "other", "", f"{type(error).__name__}: {error}")
        return 1
    return 0


def _send_error(connection: Connection, kind: str, field: str, message: str) -> None:
    try:
        connection.send(("error", kind, field, message, traceback.format_exc()))
    except OSError:
        pass


if __name__ == "__main__":
    code = main(sys.argv)
    # Straight out: a worker holds no files or buffers to close, and the interpreter's
    # teardown of numpy and numba takes a second or two, which `close` would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
