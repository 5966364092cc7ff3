"""Entry point of one trainer process: `python launch.py SPEC --role trainer --index J`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from torch.nn.parallel import DistributedDataParallel

from common.checkpoints import dense_path, final_paths, latest_complete, prune, write_manifest
from common.data.dataset import open_dataset
from common.errors import BagpipeError
from common.files import write_atomically
from common.init import initial_rows
from common.job import Job
from common.spec import Endpoint
from ps.client import PsClient
from trainer.cache import EmbeddingCache
from trainer.collectives import Collectives, close_collectives, init_collectives
from trainer.device import Device, select_device
from trainer.engine import CheckpointCallback, Engine, IterationStats, RowSource
from trainer.io_thread import IoThread
from trainer.metrics import MetricAccumulator, evaluate, held_out_share
from trainer.models import build_model
from trainer.optim import build_dense_optimizer, build_embedding_optimizer
from trainer.remote import DirectiveStream, RemoteRows
from trainer.timing import PhaseTimer

log = logging.getLogger(__name__)
INIT_CHUNK_ROWS = 1 << 20
RESTART_WATCH_S = 0.5  # how often a trainer looks for a PS shard restarted alone


@dataclass(frozen=True, kw_only=True)
class Peers:
    """Where this trainer's peers listen (resolved by the launcher for port-0 specs)."""

    oracle: Endpoint
    ps: tuple[Endpoint, ...]
    rendezvous: Endpoint


class RecordWriter:
    """Appends this trainer's JSON-lines records (read live by the launcher's progress bar)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")
        self._lock = threading.Lock()  # iterations are logged by the main thread, checkpoints by I/O

    def write(self, record: dict[str, Any]) -> None:
        line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def run_trainer(job: Job, rank: int, *, token: str, peers: Peers, run_dir: Path, resume: bool = False) -> None:
    """Train until the oracle's stream ends; with `resume`, from the latest complete
    checkpoint (dense state from it, empty cache, directives from the next iteration)."""
    spec = job.spec
    world = spec.trainers.count
    torch.set_num_threads(spec.trainers.threads)
    device = select_device(spec.trainers.device, rank)
    backend = spec.trainers.backend if spec.trainers.backend != "auto" else ("nccl" if device.is_cuda else "gloo")
    comm = init_collectives(backend, peers.rendezvous, rank, world, spec.cluster.request_timeout_s * 4)
    io = IoThread()
    records = RecordWriter(run_dir / f"trainer-{rank}.jsonl")
    ps_client = None
    watcher: concurrent.futures.Future | None = None
    try:
        # Read once: the PS client checks that every shard holds it, the engine loads its dense part.
        resumed_from = latest_complete(spec.checkpoint.dir, spec.ps.num_shards) if resume else None
        local = spec.oracle.mode == "local"
        if not local:
            # The journal lets a PS shard restart alone (from its snapshot) while this trainer
            # waits; without checkpoints there is no snapshot, so nothing is kept.
            ps_client = PsClient(
                peers.ps, token=token, dim=job.dim, state_width=job.state_width,
                transport=spec.cluster.transport, timeout_s=spec.cluster.request_timeout_s,
                retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
                journal_bytes=spec.checkpoint.journal_bytes if spec.checkpoint.every else 0,
                resumed_from=-1 if resumed_from is None else resumed_from,
            )
        if ps_client is not None and spec.checkpoint.every:
            watcher = io.submit(ps_client.watch_restarts(RESTART_WATCH_S))
        checkpoints = Checkpointer(job, rank, io, ps_client, records)
        rows = None if ps_client is None else RemoteRows(io, ps_client, wait_s=spec.cluster.fetch_timeout_s)
        engine = build_engine(job, device, comm, rows, seeded_model(job, device), on_checkpoint_written=checkpoints.report)
        start = _resume_point(job, engine, resumed_from) if resume else 0
        stream = DirectiveStream(
            io, peers.oracle, token=token, transport=spec.cluster.transport, trainer=rank,
            start=start, retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
            timeout_s=spec.cluster.fetch_timeout_s,
        )
        iterations = _train(job, engine, stream, comm, records, checkpoints)
        engine.drain()
        stream.close()
        checkpoints.wait()
        comm.barrier()  # every trainer's write-backs are acknowledged: the PS holds the model
        _finish(job, rank, engine, comm, io, ps_client, records, run_dir, iterations)
        # Leave together: trainers that left while rank 0 still saved the final model aborted
        # in gloo at exit in 2 of 32 T = 4 runs (see also launch.py on how a trainer exits).
        comm.barrier()
    finally:
        # Also after a failure: nothing may keep the process alive (the launcher waits for
        # it to exit to report the error), so no step here can block for long.
        if watcher is not None:
            watcher.cancel()
        if ps_client is not None:
            with contextlib.suppress(Exception):
                io.run(ps_client.close(), timeout=5)
        io.close()
        records.close()
        close_collectives()


def seeded_model(job: Job, device: Device) -> torch.nn.Module:
    """The dense model as every trainer (and the reference) initialises it. It seeds torch's
    global generator: trainers sharing one process must build theirs one at a time."""
    torch.manual_seed(job.spec.seed)
    return build_model(job.model, job.num_dense, job.layout.num_tables).to(device.torch_device)


def build_engine(
    job: Job, device: Device, comm: Collectives, rows: RowSource | None, model: torch.nn.Module, *,
    on_checkpoint_written: CheckpointCallback | None = None,
) -> Engine:
    """This trainer's engine: `model` (from `seeded_model`) under DDP over `comm`'s group, and
    the cache; `rows` None is local mode (the whole table in the trainer, slot = key)."""
    spec = job.spec
    ddp = DistributedDataParallel(
        model, process_group=comm.group, device_ids=[device.torch_device.index] if device.is_cuda else None,
    )
    dense_optimizer = build_dense_optimizer(job.optimizer, ddp.parameters())
    embedding_optimizer = build_embedding_optimizer(job.optimizer)
    if rows is None:
        cache = EmbeddingCache(job.layout.total_rows, job.dim, embedding_optimizer, device)
        for start in range(0, job.layout.total_rows, INIT_CHUNK_ROWS):  # bounded temporaries
            keys = np.arange(start, min(start + INIT_CHUNK_ROWS, job.layout.total_rows), dtype=np.int64)
            cache.rows[start : start + len(keys)] = torch.from_numpy(initial_rows(job.layout, spec.seed, keys, job.dim))
    else:
        cache = EmbeddingCache(spec.oracle.cache_rows, job.dim, embedding_optimizer, device)
    return Engine(
        cache=cache, model=ddp, dense_optimizer=dense_optimizer, collectives=comm, rows=rows,
        timer=PhaseTimer(), on_checkpoint_written=on_checkpoint_written,
    )


def _train(
    job: Job, engine: Engine, stream: DirectiveStream, comm: Collectives, records: RecordWriter, checkpoints: Checkpointer
) -> int:
    spec = job.spec
    row_bytes = 4 * (job.dim + job.state_width)
    progressive = MetricAccumulator()
    waited = time.perf_counter()
    engine.timer.restart()
    for step in stream:
        engine.timer.add("wait_directive", time.perf_counter() - waited)
        stats = engine.step(step.directive, step.labels, step.dense)
        if step.directive.checkpoint:
            checkpoints.save_dense(stats.iteration, engine)
        records.write(_iteration_record(stats, engine, row_bytes, 4 * job.dim))
        done = stats.iteration + 1
        if spec.train.eval_every:  # without it the predictions are never scored: keep none
            progressive.add(stats.labels, stats.probs)
            if done % spec.train.eval_every == 0:
                _record_eval(records, comm, progressive, done, split="progressive")
                progressive = MetricAccumulator()
        waited = time.perf_counter()
    # The run's length, from the stream's end: a run resumed after its last checkpoint may
    # have no step left to run.
    assert stream.iterations is not None
    return stream.iterations


class Checkpointer:
    """This trainer's part of checkpoint c (DESIGN §9): rank 0 saves the dense model and
    optimizer after iteration c; once the PS acknowledged every write of versions <= c
    (flushes included), the trainer reports c to every shard, off the critical path; the
    shards snapshot when all trainers reported; rank 0 then writes the manifest that makes
    the checkpoint complete. A failure is logged and training goes on: the previous
    complete checkpoint still holds."""

    def __init__(self, job: Job, rank: int, io: IoThread, ps: PsClient | None, records: RecordWriter) -> None:
        self.job, self.rank, self.io, self.ps, self.records = job, rank, io, ps, records
        self.directory = job.spec.checkpoint.dir
        self._dense_bytes: dict[int, int] = {}  # checkpoint -> size of its saved dense state
        self._reports: list[concurrent.futures.Future] = []

    def save_dense(self, c: int, engine: Engine) -> None:
        if self.rank != 0:
            return
        path = dense_path(self.directory, c)
        # Serialised in memory first: torch.save to a file reports a full disk as a
        # RuntimeError from its C++ writer, an OSError here.
        buffer = BytesIO()
        torch.save({"model": engine.model.module.state_dict(),
                    "optimizer": engine.dense_optimizer.state_dict(), "iteration": c}, buffer)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, buffer.getvalue())
            self._dense_bytes[c] = buffer.getbuffer().nbytes
        except OSError as exc:
            log.error("checkpoint %d: could not save the dense model to %s: %s", c, path, exc)

    def report(self, c: int, writes: list[concurrent.futures.Future]) -> None:
        if self.ps is not None:
            self._reports.append(self.io.submit(self._report(c, writes)))

    async def _report(self, c: int, writes: list[concurrent.futures.Future]) -> None:
        spec = self.job.spec
        started = time.perf_counter()
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in writes))
            assert self.ps is not None
            answers = await self.ps.report_checkpoint(c, self.rank, spec.trainers.count)
        except BagpipeError as exc:
            log.error("checkpoint %d is incomplete: %s", c, exc.message)
            return
        if self.rank == 0 and c in self._dense_bytes:
            nbytes = sum(a.nbytes for a in answers) + self._dense_bytes[c]
            seconds = time.perf_counter() - started
            try:
                await asyncio.to_thread(write_manifest, self.directory, c, spec.ps.num_shards, {"bytes": nbytes, "seconds": seconds})
            except OSError as exc:
                log.error("checkpoint %d is incomplete: its manifest could not be written to %s: %s", c, self.directory, exc)
                return
            self.records.write({"kind": "checkpoint", "iteration": c, "time": time.time(), "bytes": nbytes, "seconds": seconds})
            log.info("checkpoint %d complete: %d bytes, %.2f s after its last write was sent", c, nbytes, seconds)
            await asyncio.to_thread(self._prune)

    def _prune(self) -> None:
        """Delete what `[checkpoint] keep` no longer keeps; a failure costs only disk space."""
        spec = self.job.spec
        try:
            gone = prune(self.directory, spec.ps.num_shards, spec.checkpoint.keep)
        except OSError as exc:
            log.warning("old checkpoints in %s could not be deleted: %s", self.directory, exc)
            return
        if gone:
            log.info("deleted the checkpoints older than the %d kept: %s", spec.checkpoint.keep, ", ".join(map(str, gone)))

    def wait(self) -> None:
        """Block until every report finished (their failures are logged, not raised)."""
        for future in self._reports:
            future.result()


def _resume_point(job: Job, engine: Engine, c: int | None) -> int:
    """Load checkpoint `c`'s dense state (None: start afresh); the first iteration to run."""
    spec = job.spec
    if c is None:
        log.info("no complete checkpoint in %s: starting from iteration 0", spec.checkpoint.dir)
        return 0
    saved = torch.load(dense_path(spec.checkpoint.dir, c), map_location=engine.device)
    engine.model.module.load_state_dict(saved["model"])
    engine.dense_optimizer.load_state_dict(saved["optimizer"])
    log.info("resuming after checkpoint %d", c)
    return c + 1


def _iteration_record(stats: IterationStats, engine: Engine, row_bytes: int, grad_bytes: int) -> dict[str, Any]:
    return {
        "kind": "iter",
        "iteration": stats.iteration,
        "time": time.time(),
        "samples": stats.samples,
        "loss": stats.loss,
        "uses": stats.uses,
        "hits": stats.hits,
        "fetch_rows": stats.fetch_rows,
        "fetch_bytes": stats.fetch_rows * row_bytes,
        "write_back_rows": stats.write_back_rows,
        "write_back_bytes": stats.write_back_rows * row_bytes,
        "sync_rows": stats.sync_rows,
        "sync_bytes": stats.sync_rows * grad_bytes + stats.join_rows * row_bytes,
        "join_rows": stats.join_rows,
        "phases": engine.timer.end_iteration(),
    }


def _record_eval(records: RecordWriter, comm: Collectives, acc: MetricAccumulator, iteration: int, *, split: str) -> None:
    """Gather every trainer's predictions, score them once, record the result on rank 0."""
    labels, probs = acc.arrays()
    parts = comm.all_gather_objects((labels, probs))
    if comm.rank != 0:
        return
    result = evaluate(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    records.write({
        "kind": "eval", "split": split, "iteration": iteration, "time": time.time(),
        "auc": result.auc, "log_loss": result.log_loss, "count": result.count,
    })
    log.info("%s eval at iteration %d: AUC %.4f, log loss %.4f over %d samples",
             split, iteration, result.auc, result.log_loss, result.count)


def _finish(job: Job, rank: int, engine: Engine, comm: Collectives, io: IoThread, ps: PsClient | None,
            records: RecordWriter, run_dir: Path, iterations: int) -> None:
    """Held-out evaluation and the final model: dense state (rank 0) and the tables."""
    _record_eval(records, comm, _held_out(job, rank, engine, io, ps), iterations, split="held-out")
    if rank == 0:
        final = final_paths(run_dir)
        final.dense.parent.mkdir(parents=True, exist_ok=True)
        torch.save(engine.model.module.state_dict(), final.dense)
        if ps is None:
            np.save(final.table, engine.cache.rows.cpu().numpy())
            np.save(final.state, engine.cache.state.cpu().numpy())
        else:
            try:
                io.run(ps.snapshot(iterations))
            except BagpipeError as exc:  # training is done; say clearly that its tables were not saved
                log.error("the final tables could not be saved: %s", exc.message)
        final.info.write_bytes(orjson.dumps({"iterations": iterations, "ps_checkpoint": iterations if ps else None}))
    records.write({"kind": "final", "time": time.time(), "iterations": iterations})


def _held_out(job: Job, rank: int, engine: Engine, io: IoThread, ps: PsClient | None) -> MetricAccumulator:
    """Predictions on this trainer's share of the held-out rows, with the final parameters."""
    dataset = open_dataset(job.data)
    acc = MetricAccumulator()
    model = engine.model.module
    model.eval()
    with torch.no_grad():
        batches = dataset.eval_batches(job.spec.train.batch_size)
        for batch in held_out_share(batches, rank, job.spec.trainers.count):
            keys = job.layout.to_keys(batch.sparse)
            emb = _rows_of(keys, engine, io, ps)
            dense = torch.from_numpy(np.ascontiguousarray(batch.dense)).to(engine.device)
            logits = model(dense, emb)
            acc.add(batch.labels, torch.sigmoid(logits).cpu().numpy())
    model.train()
    return acc


def _rows_of(keys: np.ndarray, engine: Engine, io: IoThread, ps: PsClient | None) -> torch.Tensor:
    if ps is None:
        return engine.cache.rows[torch.from_numpy(keys).to(engine.device)]
    unique, inverse = np.unique(keys, return_inverse=True)
    got = io.run(ps.fetch(unique))
    return torch.from_numpy(got.rows[inverse.reshape(keys.shape)]).to(engine.device)
