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
import logging
from collections.abc import AsyncIterator, Callable

from common.checkpoints import complete_checkpoints, dense_path, is_checkpoint, is_complete, prune, write_manifest
from common.errors import BadRequest, Conflict, NotFound, StorageFailed, Unavailable, quoted
from common.files import write_atomically
from common.job import Job
from common.spec import Endpoint
from common.steps import EndOfStream, EvalBatch, held_out_share
from common.transport import Response, Router, StreamResponse, encode_message
from oracle.protocol import (
    COMPLETE_CHECKPOINT,
    DENSE,
    EVAL,
    FINISHED,
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
    Registration,
    ResumePoint,
    add_handlers,
    fingerprint,
)

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
    group meets (once, when the first trainer joins): the store and its address."""

    def __init__(self, job: Job, *, start_store: Callable[[], tuple[object, Endpoint]],
                 resumed_from: int | None = None) -> None:
        spec = job.spec
        self.job = job
        self.resumed_from = resumed_from
        self._start_store = start_store
        self._store: tuple[object, Endpoint] | None = None
        self._store_lock = asyncio.Lock()
        self.registry = Registry(num_shards=spec.ps.num_shards, num_trainers=spec.trainers.count,
                                 fingerprint=fingerprint(spec.document))
        self._ps_ready = asyncio.Event()  # set while every PS shard is registered
        self._addresses_given = False  # a trainer has been told where the shards are
        self._finished: set[int] = set()
        self.finished = asyncio.Event()  # every trainer has said it is done

    def add_routes(self, router: Router) -> None:
        add_handlers(router, {
            REGISTER: self.register, EVAL: self.eval, FINISHED: self.trainer_finished,
            COMPLETE_CHECKPOINT: self.checkpoint_complete, RESUME_POINT: self.resume_point, DENSE: self.dense_state,
        })

    async def register(self, reg: Registration) -> Joined:
        ps: tuple[Endpoint, ...] = ()
        store = None
        if reg.role == "trainer":  # answered once it can train; registered only then
            self.registry.check(reg)
            ps = await self._wait_for_ps()
            store = await self._trainer_store()
        else:
            await self._check_ps(reg)
        index, generation = self.registry.register(reg)
        log.info("%s %d joined from %s%s", reg.role, index, reg.address,
                 f" (again: {generation} time(s) before)" if generation else "")
        if not self.registry.missing_ps:
            self._ps_ready.set()
        return Joined(index=index, document=self.job.spec.document, facts=self.job.facts, ps=ps,
                      store=store, generation=generation, resumed_from=self.resumed_from)

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
        log.info("trainer %d finished (%d of %d)", trainer, len(self._finished), trainers)
        if len(self._finished) == trainers:
            self.finished.set()
        return FinishProgress(finished=len(self._finished))

    async def checkpoint_complete(self, done: DenseCheckpoint) -> CheckpointCompleted:
        spec = self.job.spec
        if not (is_checkpoint(done.checkpoint, spec.checkpoint.every) and done.checkpoint < self.job.iterations):
            raise BadRequest(f"{done.checkpoint} is not a checkpoint of this run", field="checkpoint")
        try:
            kept = await asyncio.to_thread(self._complete, done)
        except OSError as exc:
            log.error("checkpoint %d is incomplete: it could not be written to %s: %s",
                      done.checkpoint, spec.checkpoint.dir, exc)
            raise StorageFailed(f"checkpoint {done.checkpoint} could not be written to "
                                f"{spec.checkpoint.dir}: {exc}", checkpoint=done.checkpoint) from None
        log.info("checkpoint %d complete: %d bytes, %.2f s after its last write was sent",
                 done.checkpoint, done.nbytes, done.seconds)
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
        try:
            gone = prune(directory, shards, spec.checkpoint.keep)
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
