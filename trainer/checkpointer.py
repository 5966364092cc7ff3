"""A trainer's part of each checkpoint, and where a resumed run starts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from io import BytesIO

import torch

from collections.abc import Callable

from common.errors import BagpipeError, Regrouped
from common.job import Job
from oracle.coordinator_client import CoordinatorClient
from oracle.protocol import DenseCheckpoint
from ps.client import PsClient
from trainer.ps_process import PsProcess
from trainer.engine import Engine
from trainer.io_thread import IoThread
from trainer.records import CheckpointRecord, RecordWriter

log = logging.getLogger(__name__)


class Checkpointer:
    """This trainer's part of checkpoint c (docs/design.md#checkpoints): rank 0 keeps the dense model and
    optimizer as of iteration c; once the PS acknowledged every write of versions <= c
    (flushes included), the trainer reports c to every shard, off the critical path; the
    shards snapshot when all trainers reported; rank 0 then sends the dense state to the
    coordinator, which writes it and the manifest that makes the checkpoint complete
    (`oracle.coordinator_service`). A failure is logged and training goes on: the previous complete
    checkpoint still holds."""

    def __init__(self, job: Job, rank: int, io: IoThread, ps: PsClient | PsProcess | None,
                 coordinator: CoordinatorClient, records: RecordWriter,
                 on_regrouped: Callable[[Regrouped], None] | None = None) -> None:
        """`on_regrouped`: called (on the I/O thread) when the coordinator refuses a
        checkpoint because the job regroups: an elastic job's term is over."""
        self.job, self.rank, self.io, self.ps, self.records = job, rank, io, ps, records
        self.coordinator = coordinator
        self.on_regrouped = on_regrouped
        self._dense: dict[int, bytes] = {}  # checkpoint -> its dense state, until complete
        self._reports: list[concurrent.futures.Future] = []
        self._oldest_kept = -1  # the oldest complete checkpoint kept: the shards prune below it

    def save_dense(self, c: int, engine: Engine) -> None:
        if self.rank != 0:
            return
        buffer = BytesIO()
        torch.save({"model": engine.model.module.state_dict(),
                    "optimizer": engine.dense_optimizer.state_dict(), "iteration": c}, buffer)
        self._dense[c] = buffer.getvalue()

    def report(self, c: int, writes: list[concurrent.futures.Future]) -> None:
        if self.ps is not None:
            # the finished ones go (a run is unbounded: online, one every few seconds), except
            # a failure `wait` must raise
            self._reports = [f for f in self._reports if not f.done() or f.exception() is not None]
            self._reports.append(self.io.submit(self._report(c, writes)))

    async def _report(self, c: int, writes: list[concurrent.futures.Future]) -> None:
        spec = self.job.spec
        started = time.perf_counter()
        # Taken now: a checkpoint that fails is never retried, and its dense state (the
        # model and its optimizer) must not stay behind for the rest of the run.
        dense = self._dense.pop(c, None)
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in writes))
            assert self.ps is not None
            answers = await self.ps.report_checkpoint(c, self.rank, spec.trainers.count, self._oldest_kept)
        except BagpipeError as exc:
            log.error("checkpoint %d is incomplete: %s", c, exc.message)
            return
        if dense is None:
            return
        nbytes = sum(a.nbytes for a in answers) + len(dense)
        seconds = time.perf_counter() - started
        done = DenseCheckpoint(checkpoint=c, dense=dense, nbytes=nbytes, seconds=seconds)
        try:
            kept = await self.coordinator.complete_checkpoint(done)
        except Regrouped as exc:
            log.warning("checkpoint %d is not complete: %s", c, exc.message)
            if self.on_regrouped is not None:
                self.on_regrouped(exc)
            return
        except BagpipeError as exc:
            log.error("checkpoint %d is incomplete: the coordinator did not record it: %s", c, exc.message)
            return
        self._oldest_kept = min(kept, default=-1)
        self.records.write(CheckpointRecord(iteration=c, time=time.time(), bytes=nbytes, seconds=seconds))
        log.info("checkpoint %d complete: %d bytes, %.2f s after its last write was sent", c, nbytes, seconds)

    def wait(self) -> None:
        """Block until every report finished (their failures are logged, not raised)."""
        for future in self._reports:
            future.result()


def resume_point(job: Job, engine: Engine, io: IoThread, coordinator: CoordinatorClient, c: int | None) -> int:
    """Load checkpoint `c`'s dense state from the coordinator (None: start afresh); the first
    iteration to run."""
    if c is None:
        log.info("no complete checkpoint to resume from: starting from iteration 0")
        return 0
    saved = torch.load(BytesIO(io.run(coordinator.dense_state(c))), map_location=engine.device)
    engine.model.module.load_state_dict(saved["model"])
    engine.dense_optimizer.load_state_dict(saved["optimizer"])
    log.info("resuming after checkpoint %d", c)
    return c + 1
