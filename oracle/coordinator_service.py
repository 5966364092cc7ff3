"""The oracle as the job's coordinator: roles register with it and learn the job from it.

Routes (beside the directive streams of `oracle.service`; their messages are in
`oracle.protocol`):

* ``POST /v1/register``: a PS shard or trainer joins (`oracle.coordinator_client`). Indices are
  the caller's or the lowest free; a PS index registers again only from the address it had
  (a shard restarted alone must come back where the trainers look for it); a trainer's
  answer waits until every PS shard has registered. A PS shard registers the address it
  already listens on: the coordinator connects to it before it assigns an index, and until
  a trainer has been given the shards' addresses, a registration whose address no longer
  answers (its shard died) gives way to a live shard that asks for its index.
* ``POST /v1/presence``: a role of an elastic job is alive in its term (or cannot go on in
  it); the answer says whether it must start again (`oracle.membership`). A trainer that
  registers while an elastic job runs and every index is taken waits to join; while the job
  regroups, every registration waits for the next term.
* ``GET /v1/eval?trainer=J``: trainer J's share of the held-out rows (every T-th batch from
  the J-th), as framed `common.wire` messages and an end message: trainers never read the
  data.
* ``POST /v1/finished`` ``{"trainer": J}``: trainer J is done; once every trainer is, the
  oracle stops by itself (`finished`), so a batch job completes.
* Checkpoints (docs/design.md#checkpoints) are made complete here, whatever machine each role is on: each PS
  shard keeps its snapshots under its own ``[checkpoint] dir``; trainer 0 sends the dense
  state and the figures of checkpoint c once every shard has saved c (``POST
  /v1/checkpoint``), and the oracle writes them and the manifest under its own, then prunes
  what `[checkpoint] keep` drops (answering which complete checkpoints are kept, so the
  shards can prune theirs). ``GET /v1/checkpoint`` says which checkpoint this run resumed
  from (null for none) and ``GET /v1/dense?checkpoint=c`` gives its dense state.

`Registry` is the sans-IO bookkeeping; `Coordinator` the routes around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from common.checkpoints import (
    complete_checkpoints,
    dense_path,
    is_checkpoint,
    is_complete,
    latest_complete,
    prune,
    write_manifest,
)
from common.errors import BadRequest, Conflict, NotFound, Regrouped, StorageFailed, Unavailable, quoted
from common.files import write_atomically
from common.job import Job
from common.prometheus import Registry as Metrics
from common.spec import Endpoint
from common.steps import EndOfStream, EvalBatch, held_out_share
from common.transport import Response, Router, StreamResponse, encode_message
from oracle.protocol import (
    COMPLETE_CHECKPOINT,
    DENSE,
    EVAL,
    FINISHED,
    PRESENCE,
    REGISTER,
    REGISTER_HOLD_S,
    RESUME_POINT,
    CheckpointCompleted,
    DenseCheckpoint,
    DenseRequest,
    EvalRequest,
    Finished,
    FinishProgress,
    Joined,
    Presence,
    PresenceAnswer,
    Registration,
    ResumePoint,
    add_handlers,
    fingerprint,
)
from oracle.exporter import Exporter
from oracle.membership import Candidate, Decision, Membership, RegroupFailed

log = logging.getLogger(__name__)


class Registry:
    """Who has joined: PS shards by index with their addresses, trainers by index."""

    def __init__(self, *, num_shards: int, num_trainers: int, fingerprint: str) -> None:
        self.counts = {"ps": num_shards, "trainer": num_trainers}
        self.fingerprint = fingerprint
        self.ps: dict[int, Endpoint] = {}
        self.joins: dict[tuple[str, int], int] = {}  # (role, index) → times joined

    def register(self, reg: Registration) -> tuple[int, int]:
        """(index, generation) of a registration; Conflict or BadRequest naming why not."""
        index = self.check(reg)
        if reg.role == "ps":
            self.ps[index] = reg.address
        generation = self.joins.get((reg.role, index), 0)
        self.joins[(reg.role, index)] = generation + 1
        return index, generation

    def check(self, reg: Registration) -> int:
        """The index `reg` would get; Conflict or BadRequest naming why it cannot join."""
        self.check_job(reg)
        index = self._free_index(reg.role) if reg.index is None else reg.index
        if reg.role == "ps":
            had = self.ps.get(index)
            if had is not None and had != reg.address:
                raise Conflict(
                    f"PS shard {index} is registered at {had}: a shard restarted alone must come "
                    f"back there (--bind {had}), where the trainers look for it",
                    field="address",
                )
        return index

    def check_job(self, reg: Registration) -> None:
        """Conflict if `reg` comes from another job's spec, BadRequest if it names an index
        outside the job: what no other registration can change."""
        if reg.fingerprint is not None and reg.fingerprint != self.fingerprint:
            raise Conflict(
                f"this {reg.role}'s spec file differs from the coordinator's (spec fingerprint "
                f"{quoted(reg.fingerprint)}, coordinator's {self.fingerprint!r}): it belongs to another job",
                field="fingerprint",
            )
        count = self.counts[reg.role]
        if reg.index is not None and not 0 <= reg.index < count:
            raise BadRequest(f"{reg.role} index {reg.index} is outside 0..{count - 1}", field="index")

    def standing_in_the_way(self, reg: Registration) -> list[int]:
        """The PS indices whose registration at another address keeps `reg` out: its own
        index, or every index when it asks for the lowest free one and none is."""
        if reg.role != "ps":
            return []
        if reg.index is not None:
            had = self.ps.get(reg.index)
            return [] if had is None or had == reg.address else [reg.index]
        if len(self.ps) < self.counts["ps"]:
            return []
        return [i for i, address in sorted(self.ps.items()) if address != reg.address]

    def forget_ps(self, index: int) -> None:
        """Drop PS shard `index`'s registration (its shard is gone before serving anyone)."""
        self.ps.pop(index, None)
        self.joins.pop(("ps", index), None)

    def _free_index(self, role: str) -> int:
        for index in range(self.counts[role]):
            if (role, index) not in self.joins:
                return index
        raise Conflict(f"all {self.counts[role]} {role} indices have joined: give --index to restart one",
                       field="index")

    @property
    def missing_ps(self) -> list[int]:
        return [i for i in range(self.counts["ps"]) if i not in self.ps]

    def ps_addresses(self) -> tuple[Endpoint, ...]:
        return tuple(self.ps[i] for i in range(self.counts["ps"]))


class HeldTrainers:
    """The registrations of an elastic job's trainers that wait for a term: each with its
    candidate key and the future of its index. A trainer asks again when its hold runs out
    (`REGISTER_HOLD_S`); its registration's nonce makes it the same candidate, so that one
    chosen meanwhile gets the index it was given. One that stops asking is gone."""

    STALE_S = 10.0  # a held trainer not asking again for this long is gone

    def __init__(self) -> None:
        self._keys = itertools.count()
        self._by_nonce: dict[str, int] = {}
        self._futures: dict[int, asyncio.Future[int]] = {}
        self._asking: dict[int, int] = {}  # key -> requests waiting on it now
        self._last: dict[int, float] = {}  # key -> when its last request ended

    def ask(self, reg: Registration) -> tuple[int, asyncio.Future[int], bool]:
        """(key, future of its index, whether it is a new candidate) for this request."""
        key = self._by_nonce.get(reg.nonce) if reg.nonce is not None else None
        fresh = key is None
        if key is None:
            key = next(self._keys)
            if reg.nonce is not None:
                self._by_nonce[reg.nonce] = key
            self._futures[key] = asyncio.get_running_loop().create_future()
        self._asking[key] = self._asking.get(key, 0) + 1
        return key, self._futures[key], fresh

    def asked(self, key: int) -> None:
        if key in self._asking:
            self._asking[key] -= 1
            self._last[key] = time.monotonic()

    def forget(self, key: int) -> None:
        """`key` has its index: nothing more to hold."""
        self._futures.pop(key, None)
        self._asking.pop(key, None)
        self._last.pop(key, None)
        self._by_nonce = {n: k for n, k in self._by_nonce.items() if k != key}

    def place(self, indices: dict[int, int]) -> None:
        for key, index in indices.items():
            future = self._futures.get(key)
            if future is not None and not future.done():
                future.set_result(index)

    def stale(self, now: float) -> list[int]:
        """The keys no request has waited on for `STALE_S` (and that have no index): forgotten."""
        gone = [k for k, f in self._futures.items()
                if not f.done() and not self._asking.get(k) and now - self._last.get(k, now) >= self.STALE_S]
        for key in gone:
            self.forget(key)
        return gone

    def refuse(self, error: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)


#: How long the coordinator waits for a PS shard's address to accept a connection.
PROBE_TIMEOUT_S = 3.0


async def _listening(address: Endpoint) -> bool:
    """Whether something accepts a TCP connection at `address` (nothing is sent)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(address.host, address.port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class Coordinator:
    """The coordinator's routes for `job`; `start_store` starts the store where the trainers'
    group meets (once, when the first trainer joins): the store and its address.

    An elastic job (`oracle.membership`) changes `job` at each regroup: `regrouping` is set
    when one begins, `next_term` waits for its decision, and `begin_term` opens the term the
    oracle then plans for, answering the registrations it held."""

    def __init__(self, job: Job, *, start_store: Callable[[], tuple[object, Endpoint]],
                 resumed_from: int | None = None, metrics: Metrics | None = None,
                 exporter: Exporter | None = None) -> None:
        spec = job.spec
        self.job = job
        self.exporter = exporter  # [export]: checkpoints it completes are offered to it
        self.resumed_from = resumed_from
        self.metrics = metrics or Metrics()
        self._start_store = start_store
        self._store: tuple[object, Endpoint] | None = None
        self._store_lock = asyncio.Lock()
        self._fingerprint = fingerprint(spec.document)  # the spec as given, whatever the term's count
        self.membership = None if not spec.trainers.elastic else Membership(
            trainers=spec.trainers.count, min_count=spec.trainers.min_count, max_count=spec.trainers.max_count,
            batch_size=spec.train.batch_size, rejoin_timeout_s=spec.cluster.rejoin_timeout_s,
            give_up_s=spec.cluster.reconnect_s, resumed_from=resumed_from,
        )
        self.regrouping = asyncio.Event()  # a regroup has begun (elastic jobs)
        self.failed = asyncio.Event()  # an elastic job cannot go on: `failure` says why
        self.failure: BaseException | None = None
        self._decided: asyncio.Future[Decision] | None = None
        self._term_open = asyncio.Event()  # set while no regroup is under way
        self._term_open.set()
        self._waiting = HeldTrainers()
        self._open_term()

    def _open_term(self) -> None:
        spec = self.job.spec
        self.registry = Registry(num_shards=spec.ps.num_shards, num_trainers=spec.trainers.count,
                                 fingerprint=self._fingerprint)
        self._ps_ready = asyncio.Event()  # set while every PS shard is registered
        self._addresses_given = False  # a trainer has been told where the shards are
        self._finished: set[int] = set()
        self.finished = asyncio.Event()  # every trainer has said it is done

    @property
    def term(self) -> int:
        return 0 if self.membership is None else self.membership.term.number

    def add_routes(self, router: Router) -> None:
        add_handlers(router, {
            REGISTER: self.register, EVAL: self.eval, FINISHED: self.trainer_finished,
            COMPLETE_CHECKPOINT: self.checkpoint_complete, RESUME_POINT: self.resume_point, DENSE: self.dense_state,
            PRESENCE: self.presence,
        })

    async def register(self, reg: Registration) -> Joined:
        ps: tuple[Endpoint, ...] = ()
        store = None
        if reg.role == "trainer":  # answered once it can train; registered only then
            if self.membership is not None:
                reg = dataclasses.replace(reg, index=await self._place(reg))
            self.registry.check(reg)
            ps = await self._wait_for_ps()
            store = await self._trainer_store()
        else:
            await self._wait_for_term()
            await self._check_ps(reg)
        index, generation = self.registry.register(reg)
        if reg.role == "trainer" and self.membership is not None:
            self.membership.heard(index, time.monotonic())
        log.info("%s %d joined from %s%s", reg.role, index, reg.address,
                 f" (again: {generation} time(s) before)" if generation else "")
        if not self.registry.missing_ps:
            self._ps_ready.set()
        return Joined(index=index, document=self.job.spec.document, facts=self.job.facts, ps=ps,
                      store=store, generation=generation, resumed_from=self.resumed_from, term=self.term)

    async def _wait_for_term(self) -> None:
        """Hold a registration while the job regroups: it belongs to the next term."""
        try:
            async with asyncio.timeout(REGISTER_HOLD_S):
                await self._term_open.wait()
        except TimeoutError:
            raise Unavailable("the job is regrouping: ask again", waiting="regroup") from None

    async def _place(self, reg: Registration) -> int:
        """An elastic job's trainer: a free index of the term (it is forming), else it waits
        to join, as a spare or for the regroup under way; its index once it has one."""
        membership = self.membership
        assert membership is not None
        self.registry.check_job(reg)  # another job's trainer is told so, never held
        if membership.regroup is None and reg.last_term is None:
            free = [j for j in range(self.job.spec.trainers.count) if ("trainer", j) not in self.registry.joins]
            if reg.index is not None and reg.index in free:
                return reg.index
            if free and reg.index is None:
                return free[0]
        key, placed, fresh = self._waiting.ask(reg)
        if fresh:
            membership.add(Candidate(key=key, last_term=reg.last_term, last_index=reg.last_index))
            if membership.regroup is None:
                log.info("a trainer from %s waits to join at the next checkpoint (%d waiting)", reg.address,
                         len(membership.waiting))
        self._try_decide()
        try:
            async with asyncio.timeout(REGISTER_HOLD_S):
                index = await asyncio.shield(placed)
        except TimeoutError:
            raise Unavailable("waiting to join the job at its next regroup: ask again", waiting="join") from None
        finally:
            self._waiting.asked(key)
        self._waiting.forget(key)
        return index

    async def presence(self, seen: Presence) -> PresenceAnswer:
        membership = self.membership
        if membership is None:
            return PresenceAnswer(term=0, regroup=False)
        current = membership.term.number
        if seen.term == current and seen.role == "trainer":
            membership.heard(seen.index, time.monotonic())
        if seen.term == current and membership.regroup is None and self._term_open.is_set():
            if seen.failure is not None:
                self.begin_regroup(f"{seen.role} {seen.index} could not go on: {seen.failure}")
        regroup = membership.regroup is not None or seen.term != current or not self._term_open.is_set()
        if regroup and seen.role == "trainer" and seen.term == current:
            membership.told(seen.index)  # it starts again now
        return PresenceAnswer(term=current, regroup=regroup)

    def begin_regroup(self, reason: str, gone: tuple[int, ...] = ()) -> None:
        """Every role of this term starts again; the next term resumes from the latest
        complete checkpoint as of now."""
        membership = self.membership
        assert membership is not None
        spec = self.job.spec
        resume_from = latest_complete(spec.checkpoint.dir, spec.ps.num_shards)
        try:
            membership.begin(reason, resume_from, time.monotonic(), gone)
        except RegroupFailed as exc:
            self._fail(exc)
            return
        log.warning("regrouping (term %d ends): %s; every role starts again from %s", membership.term.number,
                    reason, "iteration 0" if resume_from is None else f"checkpoint {resume_from}")
        self.metrics.inc("regroups_total", help="Times an elastic job regrouped (a trainer left or joined)")
        self._term_open.clear()
        self._decided = asyncio.get_running_loop().create_future()
        self.regrouping.set()
        self._try_decide()

    def _try_decide(self) -> None:
        membership = self.membership
        if membership is None or membership.regroup is None or self._decided is None or self._decided.done():
            return
        if self.failure is not None:
            return
        try:
            decision = membership.decide(time.monotonic())
        except RegroupFailed as exc:
            self._fail(exc)
            return
        if decision is not None:
            self._decided.set_result(decision)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        log.error("%s", exc)
        self.failure = exc
        self.failed.set()
        if self._decided is not None and not self._decided.done():
            self._decided.set_exception(exc)

    async def next_term(self) -> Decision:
        """The regroup's decision, once it is made (RegroupFailed if none can be)."""
        assert self._decided is not None
        return await self._decided

    def begin_term(self, job: Job, decision: Decision) -> None:
        """Open `decision`'s term for `job` (its trainer count): registrations held for it go
        on, the trainers it took with their new indices."""
        change = decision.change
        self.job, self.resumed_from = job, decision.term.resumed_from
        self.regrouping.clear()
        self._open_term()
        self._term_open.set()
        log.warning("term %d: %d trainer(s) from iteration %d (regrouped in %.1f s, because %s)", change.term,
                    change.trainers, change.first_iteration, change.seconds, change.reason)
        self.metrics.set("trainers", change.trainers, help="Trainers of the current term")
        self.metrics.set("term", change.term, help="Times the job regrouped")
        self._waiting.place(decision.indices)

    async def watch_membership(self, every_s: float = 0.25) -> None:
        """An elastic job's clock: a trainer unheard of for rejoin_timeout_s makes the job
        regroup without it; a regroup is decided once it may be."""
        membership = self.membership
        if membership is None:
            return
        while True:
            await asyncio.sleep(every_s)
            for key in self._waiting.stale(time.monotonic()):  # it stopped asking: gone
                membership.remove(key)
            if membership.regroup is not None:
                self._try_decide()
                continue
            if not self._term_open.is_set() or len(self._finished) == membership.term.trainers:
                continue
            silent = membership.silent(time.monotonic())
            if silent:
                self.begin_regroup(f"trainer(s) {silent} unheard of for {membership.rejoin_timeout_s:g} s "
                                   "(cluster.rejoin_timeout_s)", gone=tuple(silent))

    async def _check_ps(self, reg: Registration) -> None:
        """BadRequest unless a shard listens at `reg`'s address; before any trainer knows
        the shards' addresses, forget a registration in its way whose shard is gone."""
        self.registry.check_job(reg)  # another job's shard is told so first
        if not await _listening(reg.address):
            raise BadRequest(f"nothing listens at {reg.address}: a PS shard registers the address it "
                             "serves on, once it listens there", field="address")
        if self._addresses_given:
            return
        for index in self.registry.standing_in_the_way(reg):
            had = self.registry.ps[index]
            if not await _listening(had):
                log.warning("PS shard %d registered at %s, where nothing listens any more: its index "
                            "goes to the shard at %s", index, had, reg.address)
                self.registry.forget_ps(index)
                self._ps_ready.clear()
                return

    async def _wait_for_ps(self) -> tuple[Endpoint, ...]:
        if self.job.spec.oracle.mode == "local":
            return ()
        try:
            async with asyncio.timeout(REGISTER_HOLD_S):
                while self.registry.missing_ps:  # a dead shard's index may be free again
                    await self._ps_ready.wait()
        except TimeoutError:
            raise Unavailable(f"waiting for PS shards {self.registry.missing_ps} to register") from None
        self._addresses_given = True
        return self.registry.ps_addresses()

    async def _trainer_store(self) -> Endpoint:
        async with self._store_lock:
            if self._store is None:
                self._store = await asyncio.to_thread(self._start_store)
        return self._store[1]

    async def eval(self, ask: EvalRequest) -> StreamResponse:
        trainers = self.job.spec.trainers.count
        ask.within(trainer=(0, trainers - 1))
        return StreamResponse(chunks=self._eval_chunks(ask.trainer, trainers))

    async def _eval_chunks(self, trainer: int, trainers: int) -> AsyncIterator[bytes]:
        from common.data import open_dataset

        job = self.job
        batches = open_dataset(job.data).eval_batches(job.spec.train.batch_size)
        count = 0
        for batch in held_out_share(batches, trainer, trainers):
            keys = job.layout.to_keys(batch.sparse)
            yield encode_message(EvalBatch(keys=keys, dense=batch.dense, labels=batch.labels).to_wire())
            count += 1
        yield encode_message(EndOfStream(iterations=count).to_wire())

    async def trainer_finished(self, done: Finished) -> FinishProgress:
        trainers, trainer = self.job.spec.trainers.count, done.trainer
        if trainer >= trainers:
            raise BadRequest(f"trainer must be in 0..{trainers - 1}, got {trainer}", field="trainer")
        self._finished.add(trainer)
        if self.membership is not None:
            self.membership.finished(trainer)
        log.info("trainer %d finished (%d of %d)", trainer, len(self._finished), trainers)
        if len(self._finished) == trainers:
            self.finished.set()
            self._waiting.refuse(Conflict("the job has finished before this trainer could join it", finished=True))
        return FinishProgress(finished=len(self._finished))

    async def checkpoint_complete(self, done: DenseCheckpoint) -> CheckpointCompleted:
        spec = self.job.spec
        if not (is_checkpoint(done.checkpoint, spec.checkpoint.every) and done.checkpoint < self.job.iterations):
            raise BadRequest(f"{done.checkpoint} is not a checkpoint of this run", field="checkpoint")
        if not self._term_open.is_set():  # the next term resumes from an earlier one
            if self.membership is not None:
                self.membership.told(0)  # trainer 0 sent it, and starts again on this answer
            raise Regrouped(f"the job is regrouping: checkpoint {done.checkpoint} is not made complete")
        try:
            kept = await asyncio.to_thread(self._complete, done)
        except OSError as exc:
            log.error("checkpoint %d is incomplete: it could not be written to %s: %s",
                      done.checkpoint, spec.checkpoint.dir, exc)
            raise StorageFailed(f"checkpoint {done.checkpoint} could not be written to "
                                f"{spec.checkpoint.dir}: {exc}", checkpoint=done.checkpoint) from None
        log.info("checkpoint %d complete: %d bytes, %.2f s after its last write was sent",
                 done.checkpoint, done.nbytes, done.seconds)
        if self.membership is not None and self.membership.wants_to_grow():
            self.begin_regroup(f"{len(self.membership.waiting)} trainer(s) wait to join")
        return CheckpointCompleted(checkpoint=done.checkpoint, kept=tuple(kept))

    def _complete(self, done: DenseCheckpoint) -> list[int]:
        """Write the dense state, then the manifest that makes the checkpoint complete, then
        prune; the complete checkpoints kept."""
        spec = self.job.spec
        directory, shards = spec.checkpoint.dir, spec.ps.num_shards
        dense = dense_path(directory, done.checkpoint)
        dense.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(dense, done.dense)
        write_manifest(directory, done.checkpoint, shards, {"bytes": done.nbytes, "seconds": done.seconds})
        if self.exporter is not None:
            self.exporter.offer(done.checkpoint)
        try:
            protect = self.exporter.protected() if self.exporter is not None else set()
            gone = prune(directory, shards, spec.checkpoint.keep, protect=protect)
        except OSError as exc:  # costs only disk space
            log.warning("old checkpoints in %s could not be deleted: %s", directory, exc)
        else:
            if gone:
                log.info("deleted the checkpoints older than the %d kept: %s", spec.checkpoint.keep,
                         ", ".join(map(str, gone)))
        return complete_checkpoints(directory, shards)

    async def resume_point(self, _: None) -> ResumePoint:
        return ResumePoint(resumed_from=self.resumed_from)

    async def dense_state(self, ask: DenseRequest) -> Response:
        """Checkpoint c's dense state as trainer 0 sent it: opaque bytes (`torch.save`)."""
        spec = self.job.spec
        c = ask.within(checkpoint=(0, self.job.iterations)).checkpoint
        if not is_complete(spec.checkpoint.dir, c, spec.ps.num_shards):
            raise NotFound(f"checkpoint {c} is not complete in {spec.checkpoint.dir}", checkpoint=c)
        return Response(body=await asyncio.to_thread(dense_path(spec.checkpoint.dir, c).read_bytes))
