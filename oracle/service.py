"""The oracle process: reads the data, runs the planner ahead, streams one directive stream
per trainer (docs/design.md#roles, #the-planner, #wire-format-and-transport).

Routes (their messages are in `oracle.protocol`):

* ``GET /v1/stream?trainer=J&start=X``: trainer J's steps from global iteration X on, as
  framed messages (`common.steps`): a batch and a directive per iteration, then an end
  message (at once for X = `num_iterations`). J must be a trainer of the run and X within
  the workload's `start` .. `num_iterations`, else 400 naming the parameter; steps before
  the oldest kept iteration answer 409; once the planner has failed, its error.
* ``POST /v1/stream/ack?trainer=J&next=X``: trainer J has received every step before X
  (204). Steps are kept, and the planner held, by each trainer's *position*, which only
  these acknowledgements and the starts of J's streams move, never by more than was sent
  for J (`oracle.buffer`): a stray reader of a trainer's stream, however much of it it
  reads, makes the oracle drop no step the trainer still needs.
* ``POST /v1/ingest``: rows pushed to a stream, in its format; 200 with the part they became
  once they are on disk (fsync, then rename), 400 naming the first bad line (nothing kept).
* ``POST /v1/stop``: a stream (`data.watch`) ends at its next checkpoint, as on SIGTERM
  (202); a run over a data set answers 409.
* ``GET /v1/health``, ``GET /metrics`` (public): Prometheus text of the planner's progress
  and rate, each trainer's position and the steps held ahead of it, and the open streams.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np

from common.data.dataset import Dataset
from common.errors import BagpipeError, ConfigError, Conflict
from common.keys import TableLayout
from common.prometheus import FinalScrape, Registry
from common.steps import EndOfStream, trainer_steps
from common.transport import Response, Router, StreamResponse, encode_message
from oracle.buffer import StepBuffer
from oracle.config import PlannerConfig
from oracle.live import LivePlanner
from oracle.stream import LiveWorkload, SegmentLog, freshness, weighted_percentile
from oracle.protocol import (
    ACKNOWLEDGE,
    HEALTH,
    INGEST,
    METRICS,
    STOP,
    STREAM,
    IngestBody,
    IngestReceipt,
    OracleHealth,
    Route,
    StreamAck,
    StreamRequest,
    add_handlers,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The training stream the oracle plans: which batches, in which order.

    `start` is the first global iteration planned (c + 1 when resuming from checkpoint c,
    docs/design.md#resuming-every-role); `num_iterations` is the length of the whole run, whatever `start` is.
    """

    dataset: Dataset
    layout: TableLayout
    batch_size: int
    epochs: int
    max_iterations: int  # 0: all batches of all epochs
    start: int = 0

    def __post_init__(self) -> None:
        if type(self.start) is not int or not 0 <= self.start <= self.num_iterations:
            raise ConfigError(
                "--first-iteration",
                f"must be in 0..{self.num_iterations}, got {self.start!r} (given, or after the checkpoint resumed from)",
            )

    @property
    def num_iterations(self) -> int:
        total = self.dataset.num_batches(self.batch_size, self.epochs)
        return min(total, self.max_iterations) if self.max_iterations else total

    def key_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(global keys [B, F], labels [B], dense [B, num_dense]) of iterations start ..
        num_iterations - 1, in order."""
        batches = self.dataset.train_batches(self.batch_size, epochs=self.epochs, start=self.start)
        for _, batch in zip(range(self.start, self.num_iterations), batches):
            yield self.layout.to_keys(batch.sparse), batch.labels, batch.dense


_KeyBatch = tuple[np.ndarray, np.ndarray, np.ndarray]  # what `Workload.key_batches` yields
_T = TypeVar("_T")


LAG_EVERY_S = 0.5  # how often a stream's lag is sampled (for its summary)
LAG_SAMPLES = 100_000  # the samples kept: the last 14 hours at that rate, a bounded memory


@dataclass(frozen=True, kw_only=True)
class PlannerProgress:
    """What the planning thread has done so far. It publishes a new one after each step (one
    reference swap), so the event loop always reads a consistent set of totals."""

    iterations: int = 0  # iterations whose directives are final
    key_uses: int = 0  # key uses fed to the planner (batch x tables per iteration read)
    planning_s: float = 0.0  # inside the planner: its own work, not waiting for data or trainers
    waited_s: float = 0.0  # blocked because the trainers were max_ahead behind (back-pressure)
    waiting_since: float | None = None  # perf_counter() when the current wait began
    # CPU seconds of the planning thread by phase (what a sample costs the oracle where)
    read_cpu_s: float = 0.0  # the data: the next batch read and turned into keys
    plan_cpu_s: float = 0.0  # the planner in this thread (with workers: checks and merging)
    workers_cpu_s: float = 0.0  # the planner's worker processes (oracle.planner_workers > 1)
    encode_cpu_s: float = 0.0  # each trainer's step (batch rows and directive) encoded

    @property
    def key_uses_per_s(self) -> float:
        return self.key_uses / self.planning_s if self.planning_s > 0 else math.nan

    def waiting_s(self, now: float) -> float:
        """Seconds blocked by back-pressure up to `now`, the wait going on included."""
        return self.waited_s + (0.0 if self.waiting_since is None else now - self.waiting_since)


class OracleService:
    """Plans `workload` with `config` in a thread and serves the per-trainer streams.

    `config.first_iteration` must equal `workload.start`: the planner numbers its directives
    from it and the stream serves iterations from it. `restarted_alone`: the trainers run
    on from wherever they were, so each one's first stream counts from where it starts
    (`oracle.buffer`).
    """

    def __init__(
        self,
        config: PlannerConfig,
        workload: Workload | LiveWorkload,
        *,
        max_ahead: int,
        restarted_alone: bool = False,
        registry: Registry | None = None,
        segment_log: SegmentLog | None = None,
        export_dir: Path | None = None,
    ) -> None:
        if config.first_iteration != workload.start:
            raise ConfigError(
                "--first-iteration",
                f"{config.first_iteration} differs from the workload's first iteration {workload.start}",
            )
        self.config = config
        self.workload = workload
        self.max_ahead = max_ahead
        self.restarted_alone = restarted_alone
        self.metrics = registry or Registry()
        self.final_scrape = FinalScrape()  # finished by the coordinator, once every trainer is
        self.progress = PlannerProgress()
        self._lag_seconds: collections.deque[float] = collections.deque(maxlen=LAG_SAMPLES)
        self._lag_max = (0, 0.0)  # rows, seconds
        self._lag_sampler: asyncio.Task[None] | None = None
        self.streams_open = [0] * config.num_trainers  # every open stream, counted or not
        self.buffer: StepBuffer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_clock: int | None = None
        self.failed: asyncio.Future[BaseException] | None = None
        # a live stream's cuts: those of the plan replayed (restarted alone), logged as made
        self._segment_log = segment_log
        self._export_dir = export_dir  # where a stream's exports go ([export]): its freshness
        self._replayed_ends: list[int] = []
        self._end = workload.num_iterations  # a stream's moves to where a stop ends it
        self._stop_requested = threading.Event()
        self._end_fixed = False
        if segment_log is not None:
            if restarted_alone:
                self._replayed_ends = segment_log.ends_of(workload.start)
            else:
                segment_log.begin(workload.start)

    #: Each route of `SERVICE_ROUTES` and the method that serves it.
    HANDLERS: ClassVar[dict[Route, str]] = {STREAM: "stream", ACKNOWLEDGE: "acknowledge", HEALTH: "health",
                                            METRICS: "render_metrics", STOP: "stop_stream", INGEST: "ingest"}

    def router(self) -> Router:
        router = Router()
        add_handlers(router, {route: getattr(self, name) for route, name in self.HANDLERS.items()})
        return router

    def start(self) -> None:
        """Start planning in a background thread (call from the event loop)."""
        loop = asyncio.get_running_loop()
        self._loop_clock = time.pthread_getcpuclockid(threading.get_ident())  # the serving thread's CPU
        first = self.workload.start
        self.buffer = StepBuffer(
            self.config.num_trainers, self.max_ahead, loop, first=first,
            end=self._end, restarted_alone=self.restarted_alone,
        )
        self.failed = loop.create_future()
        self._thread = threading.Thread(target=self._plan, name="planner", daemon=True)
        self._thread.start()
        if self.is_stream:
            self._lag_sampler = loop.create_task(self._sample_lag())

    @property
    def is_stream(self) -> bool:
        return isinstance(self.workload, LiveWorkload)

    @property
    def stopping(self) -> bool:
        """Whether a stop of the stream was asked for."""
        return self._stop_requested.is_set()

    @property
    def end(self) -> int:
        """The run's length: a data set's; a stream's most, until a stop fixes it."""
        return self._end

    def request_stop(self) -> None:
        """End a stream at its next checkpoint (at once without checkpoints): it plans the
        batches up to there, as they arrive, then ends as a run does, with a complete
        checkpoint and the final model. Conflict (409) for a run over a data set."""
        if not isinstance(self.workload, LiveWorkload):
            raise Conflict("a run over a data set ends with its data; only a stream (data.watch) is stopped")
        if not self._stop_requested.is_set():
            log.info("stop requested: the stream ends at its next checkpoint")
        self._stop_requested.set()

    def stream_lag(self) -> tuple[int, float]:
        """How far the trainers are behind a stream's newest arrival: the rows of the full
        batches taken that the slowest trainer has not received, and the seconds since the
        oldest of them arrived; (0, 0.0) when it has every batch there is (a partial batch
        waits for rows, not for the trainers)."""
        assert isinstance(self.workload, LiveWorkload) and self.buffer is not None
        source, b = self.workload.source, self.workload.batch_size
        received = min(self.buffer.depths().positions) * b
        rows = min(source.num_rows // b, self.end) * b - received
        if rows <= 0:
            return 0, 0.0
        return rows, max(0.0, time.time() - source.taken_s(received))

    def stream_summary(self) -> dict[str, object]:
        """What a stream's run did: its parts, rows, bad rows and lag (the report's)."""
        assert isinstance(self.workload, LiveWorkload)
        source = self.workload.source
        lag = np.array(self._lag_seconds or [0.0])
        summary = {"parts": len(source.parts), "rows": source.num_rows, "bad_rows": source.bad_rows,
                   "iterations": self.end, "cuts": len(self._segment_log.ends_of(self.workload.start))
                   if self._segment_log is not None else 0,
                   "lag_rows_max": self._lag_max[0], "lag_s_max": self._lag_max[1],
                   "lag_s_p50": float(np.percentile(lag, 50)), "lag_s_p99": float(np.percentile(lag, 99))}
        if self._export_dir is not None:
            from serving.chain import ExportChain

            links = ExportChain.read(self._export_dir).links
            seconds, rows = freshness(source.parts, [(x.checkpoint, x.exported_s) for x in links],
                                      self.workload.batch_size)
            summary |= {"exports": len(links), "freshness_s_p50": weighted_percentile(seconds, rows, 50),
                        "freshness_s_p99": weighted_percentile(seconds, rows, 99),
                        "freshness_s_max": float(seconds.max()) if seconds.size else float("nan")}
        return summary

    async def _sample_lag(self) -> None:
        while True:
            rows, seconds = self.stream_lag()
            self._lag_seconds.append(seconds)
            self._lag_max = (max(self._lag_max[0], rows), max(self._lag_max[1], seconds))
            await asyncio.sleep(LAG_EVERY_S)

    def stop(self) -> None:
        if self._lag_sampler is not None:
            self._lag_sampler.cancel()
        self._stop.set()
        if self.buffer is not None:
            self.buffer.fail(RuntimeError("the oracle is stopping"))
        if self._thread is not None:
            self._thread.join(10)

    # -- planning thread -----------------------------------------------------------------

    def _plan(self) -> None:
        assert self.buffer is not None
        planner = LivePlanner(self.config, ends=self._replayed_ends)
        batches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        try:
            if isinstance(self.workload, LiveWorkload):
                self._plan_live(planner, batches)
            else:
                start = self.workload.start
                for x, (keys, labels, dense) in enumerate(self._read(self.workload.key_batches()), start=start):
                    if self._stop.is_set():
                        return
                    batches[x] = (labels, dense)
                    self._publish(self._timed(planner, lambda: planner.push(keys), keys.size), batches)
            if self._stop.is_set():
                return
            self._publish(self._timed(planner, planner.finish, 0), batches)
            log.info("planned all %d iterations", self.end)
        except Exception as exc:
            log.exception("planner failed")
            self.buffer.fail(exc)
            assert self.failed is not None
            self.failed.get_loop().call_soon_threadsafe(_set_once, self.failed, exc)
        finally:
            planner.close()  # its worker processes, if any (oracle.planner_workers), on stop too

    def _plan_live(self, planner: LivePlanner, batches: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Plan a stream's batches as their rows arrive. Where the next batch has not
        arrived and every trainer has been handed all there is, the plan is cut
        (`oracle.live`): the trainers train through what has arrived instead of waiting
        for the lookahead to fill."""
        workload = self.workload
        assert isinstance(workload, LiveWorkload) and self.buffer is not None and self._segment_log is not None
        x = workload.start
        while x < self._end_at(x):
            while not workload.arrived(x):
                if self._stop.is_set():
                    return
                if x >= self._end_at(x):
                    return
                if planner.in_segment and self.buffer.caught_up():
                    self._segment_log.end(planner.read)  # logged before any directive it ends is sent
                    self._publish(self._timed(planner, planner.end_segment, 0), batches)
                    continue
                self._timed_read(workload.refresh)
                if workload.arrived(x):
                    break
                if planner.in_segment:  # wakes as soon as the trainers catch up: then cut
                    self.buffer.wait_caught_up(workload.poll_s)
                else:
                    self._stop.wait(workload.poll_s)
            keys, labels, dense = self._timed_read(lambda: workload.batch(x))
            batches[x] = (labels, dense)
            self._publish(self._timed(planner, lambda: planner.push(keys), keys.size), batches)
            x += 1

    def _end_at(self, x: int) -> int:
        """The stream's end, with x the next batch to plan: once a stop is asked for, the
        iteration after the first checkpoint from x - 1 on (x itself without checkpoints),
        so that every batch planned is trained and the run ends with a checkpoint."""
        if self._stop_requested.is_set() and not self._end_fixed:
            self._end_fixed = True
            every = self.config.checkpoint_every
            self._end = min(x if every == 0 else -(-x // every) * every, self._end)
            assert self.buffer is not None
            self.buffer.set_end(self._end)
            log.info("the stream ends after iteration %d", self._end - 1)
        return self._end

    def _timed_read(self, read: Callable[[], _T]) -> _T:
        started = time.thread_time()
        out = read()
        p = self.progress
        self.progress = dataclasses.replace(p, read_cpu_s=p.read_cpu_s + time.thread_time() - started)
        return out

    def _read(self, batches: Iterator[_KeyBatch]) -> Iterator[_KeyBatch]:
        """`batches`, the CPU of reading each counted (`PlannerProgress.read_cpu_s`)."""
        while (batch := self._timed_read(lambda: next(batches, None))) is not None:
            yield batch

    def _timed(self, planner: LivePlanner, plan: Callable[[], list], key_uses: int) -> list:
        started, cpu = time.perf_counter(), time.thread_time()
        final = plan()
        p = self.progress
        self.progress = dataclasses.replace(
            p, key_uses=p.key_uses + key_uses, planning_s=p.planning_s + time.perf_counter() - started,
            plan_cpu_s=p.plan_cpu_s + time.thread_time() - cpu, workers_cpu_s=planner.worker_cpu_s,
        )
        return final

    def _publish(self, final: list, batches: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        assert self.buffer is not None
        for directives in final:
            x = directives[0].iteration
            cpu = time.thread_time()
            steps = trainer_steps(directives, *batches.pop(x))
            messages = [encode_message(s.batch.to_wire()) + encode_message(s.directive.to_wire()) for s in steps]
            p = self.progress
            self.progress = dataclasses.replace(
                p, encode_cpu_s=p.encode_cpu_s + time.thread_time() - cpu, waiting_since=time.perf_counter()
            )
            self.buffer.put(x, messages)
            p = self.progress
            self.progress = dataclasses.replace(
                p, iterations=p.iterations + 1, waiting_since=None, waited_s=p.waiting_s(time.perf_counter())
            )

    # -- routes --------------------------------------------------------------------------

    async def stream(self, ask: StreamRequest) -> StreamResponse:
        assert self.buffer is not None
        ask.within(trainer=(0, self.config.num_trainers - 1), start=(self.workload.start, self.end))
        trainer, start = ask.trainer, ask.start
        self.buffer.check_resumable(start)
        log.info("trainer %d streams from iteration %d", trainer, start)
        return StreamResponse(chunks=self._chunks(trainer, start))

    async def _chunks(self, trainer: int, start: int) -> AsyncIterator[bytes]:
        assert self.buffer is not None
        # Counted here, not in `stream`: the server closes this generator however the stream
        # ends, but only once it has started.
        self.buffer.open_stream(trainer, start)
        self.streams_open[trainer] += 1
        try:
            x = start
            while (message := await self._next(trainer, x)) is not None:
                self.buffer.handing(trainer, x)
                yield message
                self.buffer.retain_from(x + 1 - self.max_ahead)
                self.metrics.inc("steps_sent_total", labels={"trainer": str(trainer)}, help="Steps streamed")
                x += 1
            if not self._stop.is_set():
                yield encode_message(EndOfStream(iterations=x).to_wire())
        finally:
            self.streams_open[trainer] -= 1

    async def _next(self, trainer: int, x: int) -> bytes | None:
        """Step x of `trainer`'s stream; None at the end, or once planning stops (an elastic
        job's regroup: the stream just ends, without an end message)."""
        assert self.buffer is not None
        try:
            return await self.buffer.get(trainer, x)
        except BagpipeError:
            if self._stop.is_set():
                return None
            raise

    def stop_stream(self, _: None) -> Response:
        """``POST /v1/stop``: end a stream at its next checkpoint (202); 409 for a run over
        a data set, which ends with its data."""
        self.request_stop()
        return Response(status=202)

    async def ingest(self, body: IngestBody) -> IngestReceipt:
        """``POST /v1/ingest``: rows pushed to a stream, answered once they are a part of it
        on disk (`common.data.spool`); 400 naming the bad line, 409 for a run over a data set."""
        if not isinstance(self.workload, LiveWorkload):
            raise Conflict("a run over a data set takes no pushed rows; only a stream (data.watch) does")
        got = await asyncio.to_thread(self.workload.source.spool.accept, body.data)
        self.metrics.inc("stream_rows_pushed_total", got.rows, help="Rows pushed to the stream (POST /v1/ingest)")
        return IngestReceipt(part=got.part, rows=got.rows)

    def acknowledge(self, ack: StreamAck) -> Response:
        """Trainer J has received every step before `next` (answered at once, without a
        body: an answer must not wait for flow-control credit the stream holds)."""
        assert self.buffer is not None
        ack.within(trainer=(0, self.config.num_trainers - 1), next=(self.workload.start, self.end))
        self.buffer.acknowledge(ack.trainer, ack.next)
        return Response(status=204)

    async def health(self, _: None) -> OracleHealth:
        return OracleHealth(role="oracle", mode=self.config.mode, trainers=self.config.num_trainers,
                            iterations=self.end, planned=self.progress.iterations)

    async def render_metrics(self, _: None) -> Response:
        self._copy_progress()
        body = self.metrics.render().encode()
        self.final_scrape.scraped()
        return Response(body=body, content_type="text/plain; version=0.0.4")

    def cpu_by_phase(self) -> dict[str, float]:
        """CPU seconds so far by phase: reading the data, planning (this process, then the
        planner's workers), encoding the steps, and serving them (the event loop's thread:
        sending the steps, the acknowledgements, scrapes). Divided by the samples planned
        (iterations x train.batch_size), what a sample costs the oracle where."""
        p = self.progress
        serve = time.clock_gettime(self._loop_clock) if self._loop_clock is not None else 0.0
        return {"read": p.read_cpu_s, "plan": p.plan_cpu_s, "plan_workers": p.workers_cpu_s,
                "encode": p.encode_cpu_s, "serve": serve}

    def _copy_progress(self) -> None:
        """Copy what the planning thread and the buffer hold into the registry (which only
        this event loop touches)."""
        p, m = self.progress, self.metrics
        m.set("run_iterations", self.end, help="Iterations of the whole run (a stream's: the most it may have)")
        m.set_total("iterations_planned_total", p.iterations, help="Iterations whose directives are final")
        m.set_total("planner_key_uses_total", p.key_uses, help="Key uses fed to the planner")
        m.set_total("planner_seconds_total", p.planning_s, help="Seconds the planner worked")
        m.set("planner_key_uses_per_second", p.key_uses_per_s,
              help="Planning rate: key uses per second of the planner's own work")
        m.set_total("planner_waiting_seconds_total", p.waiting_s(time.perf_counter()),
                    help="Seconds the planner waited because the slowest trainer was max_ahead behind")
        m.set("planner_waiting", int(p.waiting_since is not None),
              help="1 while the planner waits for the slowest trainer (back-pressure)")
        for phase, seconds in self.cpu_by_phase().items():
            m.set_total("oracle_cpu_seconds_total", seconds, {"phase": phase},
                        help="CPU seconds of the oracle by phase: read, plan, plan_workers, encode, serve")
        if self.buffer is None:
            return
        if isinstance(self.workload, LiveWorkload):
            source = self.workload.source
            rows, seconds = self.stream_lag()
            m.set_total("stream_rows_taken_total", source.num_rows, help="Rows taken from the stream's parts")
            m.set_total("stream_parts_taken_total", len(source.parts), help="Parts of the stream taken")
            m.set_total("stream_bad_rows_total", source.bad_rows, help="Malformed rows of the stream, quarantined")
            m.set("stream_lag_rows", rows, help="Rows taken that the slowest trainer has not received")
            m.set("stream_lag_seconds", seconds, help="Seconds since the oldest row the slowest trainer lacks arrived")
        depths = self.buffer.depths()
        m.set("steps_held", depths.held, help="Steps kept in memory (not yet sent, or kept for a resume)")
        for trainer, position in enumerate(depths.positions):
            labels = {"trainer": str(trainer)}
            m.set("trainer_position", position, labels,
                  help="The first step trainer J has not acknowledged receiving")
            m.set("steps_ahead", depths.produced - position, labels,
                  help="Final steps planned beyond trainer J's position, not yet sent")
            m.set("streams_open", self.streams_open[trainer], labels, help="Open directive streams of trainer J")


def _set_once(future: asyncio.Future[BaseException], exc: BaseException) -> None:
    if not future.done():
        future.set_result(exc)

