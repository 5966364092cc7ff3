"""Entry point of one trainer process: `python launch.py SPEC --role trainer --index J`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import orjson
import torch
from torch.nn.parallel import DistributedDataParallel

from common.addresses import address_towards
from common.errors import BagpipeError, ConfigError
from common.checkpoints import final_paths
from common.init import initial_rows
from common.job import Job
from common.runtime import configure_logging
from common.spec import Endpoint
from common.steps import EvalBatch
from common.transport import Tls, run
from oracle.coordinator_client import CoordinatorClient
from oracle.protocol import DenseCheckpoint, Joined
from ps.client import PsClient
from trainer.cache import EmbeddingCache
from trainer.collectives import Collectives, Rendezvous, close_collectives, init_collectives
from trainer.device import Device, select_device
from trainer.engine import CheckpointCallback, Engine, IterationStats, RowSource
from trainer.exporter import TrainerMetrics, serve
from trainer.io_thread import IoThread
from trainer.metrics import MetricAccumulator, evaluate
from trainer.models import build_model
from trainer.optim import build_dense_optimizer, build_embedding_optimizer
from trainer.records import (
    CheckpointRecord, EvalRecord, FinalRecord, IterationRecord, MetricsRecord, RecordWriter, ThreadsRecord,
    trainer_log_path,
)
from trainer.remote import DirectiveStream, OracleLink, RemoteRows, eval_batches, report_finished
from trainer.threads import THREADS_EVERY, thread_cpu
from trainer.timing import PhaseTimer

log = logging.getLogger(__name__)
INIT_CHUNK_ROWS = 1 << 20
RESTART_WATCH_S = 0.5  # how often a trainer looks for a PS shard restarted alone


@dataclass(frozen=True, kw_only=True)
class Peers:
    """Where this trainer's peers listen: from the coordinator, or from the spec and the
    command line (resolved by the launcher for port-0 specs)."""

    oracle: Endpoint
    ps: tuple[Endpoint, ...]
    rendezvous: Rendezvous


def run_trainer(
    job: Job, rank: int, *, token: str, peers: Peers, run_dir: Path, resume: bool = False, tls: Tls | None = None,
) -> None:
    """Train until the oracle's stream ends; with `resume`, from the latest complete
    checkpoint (dense state from it, empty cache, directives from the next iteration). With
    `tls`, every connection to the oracle and the PS shards, and the metrics port, is TLS;
    the collectives (gloo, NCCL) are not HTTP and stay as they are (docs/operations.md)."""
    spec = job.spec
    world = spec.trainers.count
    torch.set_num_threads(spec.trainers.threads)
    device = select_device(spec.trainers.device, rank)
    model = seeded_model(job, device)  # before the rendezvous: a bad `[model] factory` fails alone
    backend = spec.trainers.backend if spec.trainers.backend != "auto" else ("nccl" if device.is_cuda else "gloo")
    comm = init_collectives(backend, peers.rendezvous, rank, world, spec.cluster.request_timeout_s * 4)
    io = IoThread()
    records = RecordWriter(trainer_log_path(run_dir, rank))
    metrics = TrainerMetrics(rank)
    ps_client = None
    watcher: concurrent.futures.Future | None = None
    scrapes = None
    try:
        scrapes = io.run(serve(metrics, spec, token, tls))
        records.write(MetricsRecord(time=time.time(), url=scrapes.url))
        # The coordinator holds checkpoints' dense state and manifests, wherever this runs.
        coordinator = CoordinatorClient(peers.oracle, token=token, transport=spec.cluster.transport,
                                        reconnect_s=spec.cluster.reconnect_s, tls=tls)
        # Read once: the PS client checks that every shard holds it, the engine loads its dense part.
        resumed_from = io.run(coordinator.resumed_from()) if resume else None
        local = spec.oracle.mode == "local"
        if not local:
            # The journal lets a PS shard restart alone (from its snapshot) while this trainer
            # waits; without checkpoints there is no snapshot, so nothing is kept. Its rank
            # lets it tell such a shard it has replayed: the shard serves fetches once all have.
            ps_client = PsClient(
                peers.ps, token=token, dim=job.dim, state_width=job.state_width,
                transport=spec.cluster.transport, timeout_s=spec.cluster.request_timeout_s,
                retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
                journal_bytes=spec.checkpoint.journal_bytes if spec.checkpoint.every else 0,
                resumed_from=-1 if resumed_from is None else resumed_from,
                trainer=rank, trainers=world, tls=tls,
            )
        if ps_client is not None and spec.checkpoint.every:
            watcher = io.submit(ps_client.watch_restarts(RESTART_WATCH_S))
        checkpoints = Checkpointer(job, rank, io, ps_client, coordinator, records)
        rows = None if ps_client is None else RemoteRows(io, ps_client, wait_s=spec.cluster.fetch_timeout_s)
        engine = build_engine(job, device, comm, rows, model, on_checkpoint_written=checkpoints.report)
        start = _resume_point(job, engine, io, coordinator, resumed_from) if resume else 0
        stream = DirectiveStream(
            io, peers.oracle, token=token, transport=spec.cluster.transport, trainer=rank,
            start=start, retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
            timeout_s=spec.cluster.fetch_timeout_s, tls=tls,
        )
        oracle = OracleLink(endpoint=peers.oracle, token=token, transport=spec.cluster.transport,
                            timeout_s=spec.cluster.request_timeout_s, retries=spec.cluster.retries,
                            reconnect_s=spec.cluster.reconnect_s, tls=tls)
        iterations = _train(job, engine, stream, comm, records, checkpoints, metrics)
        engine.drain()
        comm.close()  # every background sum was applied by the drain
        stream.close()
        checkpoints.wait()
        comm.barrier()  # every trainer's write-backs are acknowledged: the PS holds the model
        held_out = eval_batches(io, oracle, rank)
        _finish(job, rank, engine, comm, io, ps_client, records, run_dir, iterations, held_out)
        # Leave together: trainers that left while rank 0 still saved the final model aborted
        # in gloo at exit in 2 of 32 T = 4 runs (see also launch.py on how a trainer exits).
        comm.barrier()
        metrics.finish()
        if spec.cluster.metrics_linger_s and not metrics.wait_final_read(spec.cluster.metrics_linger_s):
            log.info("no scrape read the final metrics within metrics_linger_s = %g s", spec.cluster.metrics_linger_s)
        report_finished(io, oracle, rank)
    finally:
        # Also after a failure: nothing may keep the process alive (the launcher waits for
        # it to exit to report the error), so no step here can block for long.
        if watcher is not None:
            watcher.cancel()
        if ps_client is not None:
            with contextlib.suppress(Exception):
                io.run(ps_client.close(), timeout=5)
        if scrapes is not None:
            with contextlib.suppress(Exception):
                io.run(scrapes.server.stop(), timeout=5)
        io.close()
        records.close()
        close_collectives()


def join_and_run_trainer(
    coordinator: CoordinatorClient, *, token: str, index: int | None, run_dir: Path | None,
    resume: bool = False, environ: Mapping[str, str] = os.environ,
) -> None:
    """A trainer that knows only the coordinator: register, learn the job and its peers,
    train. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) its rank is
    torchrun's and the group meets at torchrun's store; else at the coordinator's."""
    torchrun = all(k in environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if torchrun:
        index = int(environ["RANK"])
    host = address_towards(coordinator.endpoint.host)

    async def join() -> Joined:
        try:
            return await coordinator.join("trainer", index, Endpoint(host=host, port=0))
        finally:
            await coordinator.close()

    joined = run(join())
    configure_logging(f"trainer[{joined.index}]")
    job = joined.job(coordinator.endpoint)
    if torchrun and int(environ["WORLD_SIZE"]) != job.spec.trainers.count:
        raise ConfigError("WORLD_SIZE", f"is {environ['WORLD_SIZE']}, but the job has "
                                        f"trainers.count = {job.spec.trainers.count}")
    if torchrun:
        store = Endpoint(host=environ["MASTER_ADDR"], port=int(environ["MASTER_PORT"]))
        rendezvous = Rendezvous(store=store, torchrun=True)
    else:
        assert joined.store is not None
        # The store listens beside the coordinator, wherever it bound: reach it as we reach the
        # coordinator (its own name for its host may be a wildcard such as 0.0.0.0).
        store = Endpoint(host=coordinator.endpoint.host, port=joined.store.port)
        rendezvous = Rendezvous(store=store, prefix=f"bagpipe/{joined.generation}/")
    peers = Peers(oracle=coordinator.endpoint, ps=joined.ps, rendezvous=rendezvous)
    tls = None if coordinator.tls is None else coordinator.tls.following(job.spec.cluster.tls)
    # A trainer follows the coordinator: it resumes when the run does.
    run_trainer(job, joined.index, token=token, peers=peers, run_dir=run_dir or Path("runs") / job.spec.name,
                resume=resume or joined.resumed_from is not None, tls=tls)


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
    if comm.world_size > 2:  # DDP's ring all-reduce is exact only at T <= 2
        ddp.register_comm_hook(None, comm.mean_gradients_hook())
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
    job: Job, engine: Engine, stream: DirectiveStream, comm: Collectives, records: RecordWriter,
    checkpoints: Checkpointer, metrics: TrainerMetrics,
) -> int:
    spec = job.spec
    row_bytes = 4 * (job.dim + job.state_width)
    dense_bytes = _dense_gradient_bytes(engine.model) if comm.world_size > 1 else 0
    progressive = MetricAccumulator()
    waited = time.perf_counter()
    engine.timer.restart()
    for step in stream:
        engine.timer.add("wait_directive", time.perf_counter() - waited)
        stats = engine.step(step.directive, step.labels, step.dense)
        if step.directive.checkpoint:
            checkpoints.save_dense(stats.iteration, engine)
        record = _iteration_record(stats, engine, row_bytes, 4 * job.dim, dense_bytes)
        records.write(record)
        metrics.record(record)
        done = stats.iteration + 1
        if done % THREADS_EVERY == 0:
            records.write(ThreadsRecord(iteration=done, time=time.time(), cpu=thread_cpu()))
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
    """This trainer's part of checkpoint c (DESIGN §9): rank 0 keeps the dense model and
    optimizer as of iteration c; once the PS acknowledged every write of versions <= c
    (flushes included), the trainer reports c to every shard, off the critical path; the
    shards snapshot when all trainers reported; rank 0 then sends the dense state to the
    coordinator, which writes it and the manifest that makes the checkpoint complete
    (`oracle.coordinator_service`). A failure is logged and training goes on: the previous complete
    checkpoint still holds."""

    def __init__(self, job: Job, rank: int, io: IoThread, ps: PsClient | None,
                 coordinator: CoordinatorClient, records: RecordWriter) -> None:
        self.job, self.rank, self.io, self.ps, self.records = job, rank, io, ps, records
        self.coordinator = coordinator
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


def _resume_point(job: Job, engine: Engine, io: IoThread, coordinator: CoordinatorClient, c: int | None) -> int:
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


def _dense_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of dense gradients DDP all-reduces each iteration (float32 parameters)."""
    return sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def _iteration_record(
    stats: IterationStats, engine: Engine, row_bytes: int, grad_bytes: int, dense_bytes: int
) -> IterationRecord:
    sync_now, sync_later = stats.sync_now_rows * grad_bytes, stats.sync_later_rows * grad_bytes
    joins = stats.join_rows * row_bytes
    phases = engine.timer.end_iteration()
    return IterationRecord(
        iteration=stats.iteration,
        time=time.time(),
        samples=stats.samples,
        loss=stats.loss,
        uses=stats.uses,
        hits=stats.hits,
        fetch_rows=stats.fetch_rows,
        fetch_bytes=stats.fetch_rows * row_bytes,
        write_back_rows=stats.write_back_rows,
        write_back_bytes=stats.write_back_rows * row_bytes,
        sync_rows=stats.sync_now_rows + stats.sync_later_rows,
        sync_bytes=sync_now + sync_later + joins,
        join_rows=stats.join_rows,
        sync_now_bytes=sync_now,
        sync_later_bytes=sync_later,
        join_bytes=joins,
        dense_bytes=dense_bytes,
        phases=phases,
        compute_cpu=engine.timer.compute_cpu,
    )


def _record_eval(records: RecordWriter, comm: Collectives, acc: MetricAccumulator, iteration: int, *, split: str) -> None:
    """Gather every trainer's predictions, score them once, record the result on rank 0."""
    labels, probs = acc.arrays()
    parts = comm.all_gather_objects((labels, probs))
    if comm.rank != 0:
        return
    result = evaluate(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    records.write(EvalRecord(split=split, iteration=iteration, time=time.time(), auc=result.auc,
                             log_loss=result.log_loss, count=result.count))
    log.info("%s eval at iteration %d: AUC %.4f, log loss %.4f over %d samples",
             split, iteration, result.auc, result.log_loss, result.count)


def _finish(job: Job, rank: int, engine: Engine, comm: Collectives, io: IoThread, ps: PsClient | None,
            records: RecordWriter, run_dir: Path, iterations: int, held_out: Iterable[EvalBatch]) -> None:
    """Held-out evaluation and the final model: dense state (rank 0) and the tables."""
    _record_eval(records, comm, _predict(held_out, engine, io, ps), iterations, split="held-out")
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
    records.write(FinalRecord(time=time.time(), iterations=iterations))


def _predict(batches: Iterable[EvalBatch], engine: Engine, io: IoThread, ps: PsClient | None) -> MetricAccumulator:
    """Predictions on this trainer's share of the held-out rows, with the final parameters."""
    acc = MetricAccumulator()
    model = engine.model.module
    model.eval()
    with torch.no_grad():
        for batch in batches:
            # Copies: a decoded message's arrays are read-only views of its bytes.
            emb = _rows_of(batch.keys.copy(), engine, io, ps)
            dense = torch.tensor(batch.dense, device=engine.device)
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
