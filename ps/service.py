"""The parameter-server shard as an HTTP service: the routes of `ps.protocol` → `ShardStore`.

Each handler takes its route's request message, decoded, and returns its answer message;
`router` binds them to `ps.protocol.ROUTES` in one place. Requests on routes marked
`incarnation` are checked first: one meant for an earlier process of this shard is answered
409 ``restarted`` before anything else is done.

Handlers that never wait (a write-back, a fetch whose rows have their versions) answer at
once, so that the transport serves them without a task; the others return an awaitable.

A shard restarted alone (``--rejoin``) holds every fetch until each of the job's trainers
has replayed its journal to it and said so (`ps.protocol.Rejoined`): until then a row's
newest write-back may sit in a journal not yet replayed, and a fetch asking for any version
would get the snapshot's older row.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import BadRequest, Conflict, Restarted, StorageFailed, TimedOut, quoted
from common.prometheus import Counter, FinalScrape, Registry
from common.transport import Handler, Request, Response, Router, Then
from ps.checkpoint import list_checkpoints, load_snapshot, remove_before, save_snapshot, saved_checkpoint
from ps.protocol import (
    FETCH,
    HEALTH,
    INCARNATION_HEADER,
    METRICS,
    REJOINED,
    REPORT_CHECKPOINT,
    RESTORE,
    ROUTES,
    SNAPSHOT,
    STATUS,
    WRITE_BACK,
    CheckpointReport,
    CheckpointSaved,
    FetchRequest,
    Health,
    Message,
    Rejoined,
    RejoinProgress,
    Restored,
    RestoreRequest,
    Route,
    Rows,
    ShardStatus,
    SnapshotRequest,
    WriteAck,
    WriteBack,
    WriteKind,
)
from ps.store import ShardStore, Snapshot
from ps.waiting import WaitingFetches

log = logging.getLogger(__name__)

#: A handler of one route: its decoded request message (None for a GET) and the request
#: itself (headers, body size) in, its answer message (or an awaitable of it) out.
TypedHandler = Callable[[Any, Request], Message | Awaitable[Message]]


class PsService:
    """Owns one shard store and answers its routes; one instance per shard process."""

    def __init__(
        self,
        store: ShardStore,
        *,
        checkpoint_dir: Path,
        fetch_timeout_s: float,
        registry: Registry | None = None,
        rejoin_trainers: int = 0,
        num_trainers: int | None = None,
    ) -> None:
        """`rejoin_trainers`: for a shard restarted alone, the job's trainer count T; it
        serves no fetch until trainers 0..T-1 have all reported their replay. 0: a shard
        started fresh or resumed, which never holds fetches.

        `num_trainers`: the job's trainer count, which every checkpoint report and rejoin
        report must name (a report naming more would wait for ever, one naming fewer would
        snapshot early). None (tools, tests; `rejoin_trainers` when given): the first report
        of a checkpoint sets it, and the others must agree."""
        self.store = store
        self.checkpoint_dir = checkpoint_dir
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = registry or Registry()
        self._waiting = WaitingFetches(store.num_rows)
        self._woken: dict[int, asyncio.Event] = {}  # a waiting fetch's ticket → its wake-up
        # checkpoint → (the trainer count its reports name, who reported, its snapshot)
        self._reports: dict[int, tuple[int, set[int], asyncio.Future[CheckpointSaved]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._counters: dict[str, _OpCounters] = {}  # per op ("fetch", ...), made on first use
        self.incarnation = secrets.token_hex(8)
        self.term = 0  # an elastic job's term: its trainers' clients refuse a shard of another
        self.restored = -1  # the checkpoint the rows descend from: a trainer's replay needs it
        self.finished = asyncio.Event()  # set once the run's final snapshot is saved
        self.final_scrape = FinalScrape()
        self.rejoin_trainers = rejoin_trainers
        self.num_trainers = num_trainers or rejoin_trainers or None
        self._rejoin_unreported = set(range(rejoin_trainers))
        self._rejoin_open = asyncio.Event()  # set: fetches are served
        if not rejoin_trainers:
            self._rejoin_open.set()
        self._held = 0  # fetches waiting for the trainers' replays
        self._started = time.monotonic()

    def router(self) -> Router:
        typed: dict[Route, TypedHandler] = {
            FETCH: self.fetch,
            WRITE_BACK: self.write_back,
            REPORT_CHECKPOINT: self.report_checkpoint,
            SNAPSHOT: self.snapshot,
            REJOINED: self.rejoined,
            RESTORE: self.restore,
            HEALTH: self.health,
            STATUS: self.status,
        }
        handlers: dict[Route, Handler] = {r: self._serve(r, h) for r, h in typed.items()}
        handlers[METRICS] = self.render_metrics
        router = Router()
        for route in ROUTES:
            router.add(route.method, route.path, handlers[route], public=route.public)
        return router

    def _serve(self, route: Route, handler: TypedHandler) -> Handler:
        """`handler` behind `route`: the incarnation checked, the request decoded, the
        answer encoded (at once when the handler answered at once)."""

        def serve(request: Request) -> Response | Awaitable[Response]:
            if route.incarnation:
                self._check_incarnation(request)
            message = None if route.request is None else route.request.from_wire(request.body)
            answer = handler(message, request)
            if inspect.isawaitable(answer):
                return Then(answer, _encode)
            return _encode(answer)

        return serve

    def fetch(self, message: FetchRequest, request: Request) -> Rows | Awaitable[Rows]:
        """The rows at once if each has reached its version, else an awaitable of them."""
        wait_s = self.fetch_timeout_s if message.wait_s is None else message.wait_s
        if wait_s > self.fetch_timeout_s:
            # A wait longer than the spec's fetch timeout is no legitimate one (docs/design.md#fetch-waits);
            # unbounded, it would also hold the request (and its rows) for ever.
            raise BadRequest(
                f"wait_s must be at most {self.fetch_timeout_s:g} s, got {quoted(wait_s)}", field="wait_s"
            )
        local = self.store.check_fetch(message.keys, message.min_versions)
        if not self._rejoin_open.is_set():
            return self._rows_after_replays(local, message.min_versions, wait_s, request)
        if self.store.ready(local, message.min_versions):
            return self._rows(local, request)
        return self._rows_later(local, message.min_versions, wait_s, request)

    async def _rows_later(
        self, local: np.ndarray, min_versions: np.ndarray, wait_s: float, request: Request
    ) -> Rows:
        await self._wait_for_versions(local, min_versions, wait_s)
        return self._rows(local, request)

    async def _rows_after_replays(
        self, local: np.ndarray, min_versions: np.ndarray, wait_s: float, request: Request
    ) -> Rows:
        """The rows once every trainer has replayed to this shard restarted alone and they
        reached their versions, both within `wait_s`."""
        started = time.perf_counter()
        self._held += 1
        try:
            await self._until_rejoined(wait_s)
        finally:
            self._held -= 1
            self.metrics.observe("fetch_held_seconds", time.perf_counter() - started,
                                 help="Time fetches were held until every trainer had replayed")
        left = max(wait_s - (time.perf_counter() - started), 0.0)
        await self._wait_for_versions(local, min_versions, left, budget=wait_s)
        return self._rows(local, request)

    async def _until_rejoined(self, wait_s: float) -> None:
        """Return once every trainer has replayed to this shard (at once if it was not
        restarted alone); TimedOut naming those that have not after `wait_s`."""
        if self._rejoin_open.is_set():
            return
        try:
            async with asyncio.timeout(wait_s):
                await self._rejoin_open.wait()
        except TimeoutError:
            missing = sorted(self._rejoin_unreported)
            listed = ", ".join(map(str, missing))
            who = f"trainer {listed} has" if len(missing) == 1 else f"trainers {listed} have"
            raise TimedOut(
                f"PS shard {self.store.config.shard} restarted alone: {who} not replayed their "
                f"write-backs within {wait_s:g} s",
                trainers_missing=missing,
            ) from None

    def _rows(self, local: np.ndarray, request: Request) -> Rows:
        rows, state, versions = self.store.gather(local)
        self._count("fetch", len(local), request, rows.nbytes + state.nbytes)
        return Rows(rows=rows, state=state, versions=versions)

    def write_back(self, message: WriteBack, request: Request) -> WriteAck:
        m = message
        flush, replay = m.kind is WriteKind.FLUSH, m.replay
        local = self.store.check_write(
            m.keys, m.rows, m.state, m.version, flush=flush, replay=replay
        )
        written = self.store.write_back(local, m.rows, m.state, m.version, flush=flush, replay=replay)
        self._count("replay" if m.replay else "write_back", len(local), request, 0)
        self._wake(self._waiting.written(local, self.store.versions))
        return WriteAck(written=written, version=m.version)

    async def report_checkpoint(
        self, message: CheckpointReport, request: Request
    ) -> CheckpointSaved:
        c = self.store.check_version(message.checkpoint, "checkpoint")
        if c <= self.store.last_checkpoint and c not in self._reports:
            # A report retried across a restart of this shard: its snapshot may be on disk.
            saved = saved_checkpoint(self.checkpoint_dir, c)
            if saved is None:
                raise Conflict(f"checkpoint {c} was already taken", checkpoint=c)
            path, nbytes = saved
            return CheckpointSaved(checkpoint=c, path=str(path), nbytes=nbytes, seconds=0.0)
        known = self._reports.get(c)
        self._check_trainers(message.trainers, None if known is None else known[0])
        if known is None:
            known = self._reports[c] = (message.trainers, set(), asyncio.get_running_loop().create_future())
        trainers, reported, done = known
        reported.add(message.trainer)
        if len(reported) == trainers and not done.done():
            self._finish_checkpoint(c, done)
        saved = await asyncio.shield(done)
        if message.prune_before > 0:
            await asyncio.to_thread(self._prune, min(message.prune_before, c))
        return saved

    def _check_trainers(self, given: int, reported: int | None) -> None:
        """BadRequest naming `trainers` unless a report's count is the job's (`num_trainers`)
        or, not told it, the one this checkpoint's earlier reports named."""
        expected = self.num_trainers if self.num_trainers is not None else reported
        if expected is not None and given != expected:
            whose = (f"PS shard {self.store.config.shard}'s job has" if self.num_trainers is not None
                     else "the earlier reports of this checkpoint name")
            raise BadRequest(f"trainers = {given}, but {whose} {expected} trainers", field="trainers")

    def rejoined(self, message: Rejoined, request: Request) -> RejoinProgress:
        """Trainer `message.trainer` has replayed its journal to this process; the last of
        them opens the shard to fetches. Repeats change nothing."""
        expected = self.rejoin_trainers
        if not expected:  # not restarted alone: nothing to open
            return RejoinProgress(reported=0, waiting=0)
        self._check_trainers(message.trainers, expected)
        unreported = self._rejoin_unreported
        unreported.discard(message.trainer)
        if not unreported and not self._rejoin_open.is_set():
            self._rejoin_open.set()
            log.info("PS shard %d restarted alone: every trainer (%d) has replayed its write-backs, "
                     "%.1f s after the start; serving fetches", self.store.config.shard, expected,
                     time.monotonic() - self._started)
        return RejoinProgress(reported=expected - len(unreported), waiting=len(unreported))

    @property
    def rejoin_waits_for(self) -> tuple[int, ...]:
        """The trainers this shard, restarted alone, still waits for before serving fetches."""
        return tuple(sorted(self._rejoin_unreported))

    def _prune(self, oldest_kept: int) -> None:
        """Delete this shard's snapshots older than the oldest complete checkpoint kept (the
        trainers learn it from the coordinator): on a machine of its own, nobody else does."""
        try:
            gone = remove_before(self.checkpoint_dir, oldest_kept)
        except OSError as exc:  # costs only disk space
            log.warning("old snapshots in %s could not be deleted: %s", self.checkpoint_dir, exc)
            return
        if gone:
            log.info("deleted snapshots %s, older than the oldest complete checkpoint kept (%d)", gone, oldest_kept)

    async def snapshot(self, message: SnapshotRequest, request: Request) -> CheckpointSaved:
        checkpoint = self.store.check_version(message.checkpoint, "checkpoint")
        # restarted alone, the rows are whole only once every trainer has replayed to it
        await self._until_rejoined(self.fetch_timeout_s)
        saved = await self._take_checkpoint(checkpoint)
        if checkpoint == self.store.config.version_limit:
            self.final_scrape.finish()
            self.finished.set()  # the run's final snapshot: this shard's work is done
        return saved

    def _finish_checkpoint(self, checkpoint_id: int, done: asyncio.Future[CheckpointSaved]) -> None:
        async def take() -> None:
            try:
                done.set_result(await self._take_checkpoint(checkpoint_id))
            except BaseException as exc:  # every waiting reporter gets the error
                done.set_exception(exc)
            finally:
                self._reports.pop(checkpoint_id, None)

        task = asyncio.ensure_future(take())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _take_checkpoint(self, checkpoint_id: int) -> CheckpointSaved:
        """Snapshot as of `checkpoint_id` and write it out (in a thread: the loop keeps serving)."""
        started = time.perf_counter()
        snap = self.store.snapshot(checkpoint_id)
        meta = {"shard": self.store.config.shard, "num_shards": self.store.config.num_shards}
        try:
            path, nbytes = await asyncio.to_thread(save_snapshot, self.checkpoint_dir, checkpoint_id, snap, meta)
        except OSError as exc:
            log.error("checkpoint %d could not be written to %s: %s", checkpoint_id, self.checkpoint_dir, exc)
            self.metrics.inc("checkpoint_failures_total", help="Checkpoints that could not be written")
            raise StorageFailed(f"checkpoint {checkpoint_id} could not be written to {self.checkpoint_dir}: {exc}") from None
        seconds = time.perf_counter() - started
        self.metrics.observe("checkpoint_seconds", seconds, help="Time to write a checkpoint")
        self.metrics.inc("checkpoint_bytes_total", nbytes, help="Bytes written by checkpoints")
        log.info("checkpoint %d: %d rows (%d touched), %d bytes in %.3f s at %s", checkpoint_id, len(snap.local),
                 self.store.rows_held, nbytes, seconds, path)
        return CheckpointSaved(
            checkpoint=checkpoint_id, path=str(path), nbytes=nbytes, seconds=seconds
        )

    async def restore(self, message: RestoreRequest, request: Request) -> Restored:
        c = self.store.check_version(message.checkpoint, "checkpoint")
        snap, _ = await asyncio.to_thread(load_snapshot, self.checkpoint_dir, c)
        self.restore_snapshot(snap, c)
        return Restored(checkpoint=c, rows=int(len(snap.local)))

    def restore_snapshot(self, snap: Snapshot | Iterable[Snapshot], checkpoint_id: int) -> None:
        """Replace the shard's rows with checkpoint `checkpoint_id`'s snapshot (whole, or in
        parts: `ShardStore.restore`)."""
        self.store.restore(snap, checkpoint_id)
        self.restored = checkpoint_id
        self._wake(self._waiting.recheck(self.store.versions))

    def health(self, message: None, request: Request) -> Health:
        return Health(role="ps", ok=True)

    async def status(self, message: None, request: Request) -> ShardStatus:
        cfg = self.store.config
        return ShardStatus(
            shard=cfg.shard,
            num_shards=cfg.num_shards,
            rows=self.store.num_rows,
            dim=cfg.dim,
            incarnation=self.incarnation,
            restored=self.restored,
            max_version=self.store.max_version,
            last_checkpoint=self.store.last_checkpoint,
            checkpoints=tuple(list_checkpoints(self.checkpoint_dir)),
            rejoin_waits_for=self.rejoin_waits_for,
            term=self.term,
        )

    async def render_metrics(self, request: Request) -> Response:
        self.metrics.set("fetches_waiting", self.fetches_waiting,
                         help="Fetches waiting for a version or, restarted alone, for the trainers' replays")
        self.metrics.set("rejoin_trainers_waiting", len(self._rejoin_unreported),
                         help="Trainers a shard restarted alone waits for before serving fetches")
        self.metrics.set("rows_held", self.store.rows_held,
                         help="Rows this shard has touched: what its snapshots hold and its memory grows with")
        self.metrics.set("table_rows", self.store.num_rows, help="Rows this shard owns")
        body = self.metrics.render().encode()
        self.final_scrape.scraped()
        return Response(body=body, content_type="text/plain; version=0.0.4")

    async def _wait_for_versions(
        self, local: np.ndarray, min_versions: np.ndarray, timeout: float, *, budget: float | None = None
    ) -> None:
        """Return once the rows reach their versions; TimedOut after `timeout`, naming the
        fetch's whole wait `budget` (default: `timeout`)."""
        ticket = self._waiting.wait(local, min_versions, self.store.versions)
        if ticket is None:
            return
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                while ticket is not None:
                    await self._woken_up(ticket)
                    # Checked again: a restored snapshot can take rows back below versions
                    # they had reached.
                    ticket = self._waiting.wait(local, min_versions, self.store.versions)
        except TimeoutError:
            behind = self.store.behind(local, min_versions)  # a refused fetch touches no row
            raise TimedOut(
                f"{behind} of {len(local)} rows did not reach their version within "
                f"{timeout if budget is None else budget:g} s",
                rows_behind=behind,
            ) from None
        finally:
            self.metrics.observe("fetch_wait_seconds", time.perf_counter() - started,
                                 help="Time fetches waited for a write-back")

    async def _woken_up(self, ticket: int) -> None:
        woken = self._woken[ticket] = asyncio.Event()
        try:
            await woken.wait()
        finally:
            del self._woken[ticket]
            self._waiting.cancel(ticket)

    def _check_incarnation(self, request: Request) -> None:
        meant = request.headers.get(INCARNATION_HEADER)
        if meant is not None and meant != self.incarnation:
            raise Restarted(
                f"PS shard {self.store.config.shard} restarted: incarnation {self.incarnation}, not {meant}",
                incarnation=self.incarnation,
            )

    @property
    def fetches_waiting(self) -> int:
        """Fetches waiting for a version, or held until the trainers have replayed."""
        return len(self._waiting) + self._held

    def _wake(self, tickets: list[int]) -> None:
        for ticket in tickets:
            self._woken[ticket].set()

    def _count(self, op: str, rows: int, request: Request, bytes_out: int) -> None:
        counters = self._counters.get(op) or self._counters_of(op)
        counters.requests.inc()
        counters.rows.inc(rows)
        counters.bytes_in.inc(len(request.body))
        counters.bytes_out.inc(bytes_out)

    def _counters_of(self, op: str) -> _OpCounters:
        labels = {"op": op}
        counters = self._counters[op] = _OpCounters(
            requests=self.metrics.counter("requests_total", labels, "Requests served"),
            rows=self.metrics.counter("rows_total", labels, "Rows fetched or written"),
            bytes_in=self.metrics.counter("bytes_in_total", labels, "Request body bytes"),
            bytes_out=self.metrics.counter("bytes_out_total", labels, "Row bytes sent"),
        )
        return counters


@dataclass(frozen=True, kw_only=True)
class _OpCounters:
    """What `_count` counts for one op, looked up once."""

    requests: Counter
    rows: Counter
    bytes_in: Counter
    bytes_out: Counter


def _encode(answer: Message) -> Response:
    return Response(body=answer.to_parts(), content_type=answer.CONTENT_TYPE)

