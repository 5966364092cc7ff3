"""Entry point of one trainer process: `python launch.py SPEC --role trainer --index J`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NoReturn

import torch

from common.addresses import address_towards
from common.errors import ConfigError, Conflict, Regrouped
from common.job import Job
from common.runtime import LEFT_TERM_ENV, NEXT_TERM_DROPS, configure_logging, restart_process
from common.spec import Endpoint
from common.transport import Tls, run
from oracle.coordinator_client import PRESENCE_EVERY_S, CoordinatorClient
from oracle.protocol import Joined, Presence
from ps.client import PsClient
from trainer.checkpointer import Checkpointer, resume_point
from trainer.collectives import Collectives, Rendezvous, close_collectives, init_collectives, peers_unreachable
from trainer.device import select_device
from trainer.engine import Engine
from trainer.evaluation import MetricAccumulator
from trainer.final import finish_run
from trainer.io_thread import IoThread
from trainer.ps_process import PsProcess
from trainer.records import MetricsRecord, RecordWriter, TermRecord, ThreadsRecord, trainer_log_path
from trainer.remote import DirectiveStream, OracleLink, RemoteRows, eval_batches, report_finished
from trainer.reporting import dense_gradient_bytes, iteration_record, record_eval
from trainer.scrape import TrainerMetrics, serve
from trainer.startup import build_engine, seeded_model
from trainer.threads import THREADS_EVERY, ThreadClock, helper_cpu

log = logging.getLogger(__name__)
RESTART_WATCH_S = 0.5  # how often a trainer looks for a PS shard restarted alone


@dataclass(frozen=True, kw_only=True)
class Peers:
    """Where this trainer's peers listen: from the coordinator, or from the spec and the
    command line (resolved by the launcher for port-0 specs)."""

    oracle: Endpoint
    ps: tuple[Endpoint, ...]
    rendezvous: Rendezvous
    joined: bool = False  # through the coordinator at `oracle` (so are the PS shards)


def run_trainer(
    job: Job, rank: int, *, token: str, peers: Peers, run_dir: Path, resume: bool = False, tls: Tls | None = None,
    presence: Presence | None = None,
) -> None:
    """Train until the oracle's stream ends; with `resume`, from the latest complete
    checkpoint (dense state from it, empty cache, directives from the next iteration). With
    `tls`, every connection to the oracle and the PS shards, and the metrics port, is TLS;
    the collectives (gloo, NCCL) are not HTTP and stay as they are (docs/operations.md).
    `presence`: a trainer of an elastic job, which tells the coordinator it is alive and
    starts again for the next term as soon as the coordinator says its term is over."""
    spec = job.spec
    world = spec.trainers.count
    local = spec.oracle.mode == "local"
    # Forked before this process starts any thread (the collectives' and the I/O thread's).
    helper = (PsProcess.start(dim=job.dim, state_width=job.state_width, wait_s=spec.cluster.fetch_timeout_s)
              if spec.trainers.ps_client == "process" and not local else None)
    torch.set_num_threads(spec.trainers.threads)
    device = select_device(spec.trainers.device, rank)
    model = seeded_model(job, device)  # before the rendezvous: a bad `[model] factory` fails alone
    backend = spec.trainers.backend if spec.trainers.backend != "auto" else ("nccl" if device.is_cuda else "gloo")
    comm = init_collectives(backend, peers.rendezvous, rank, world, spec.cluster.request_timeout_s * 4)
    io = IoThread()
    records = RecordWriter(trainer_log_path(run_dir, rank))
    metrics = TrainerMetrics(rank)
    ps_client: PsClient | PsProcess | None = None
    watcher: concurrent.futures.Future | None = None
    present: concurrent.futures.Future | None = None
    scrapes = None
    try:
        scrapes = io.run(serve(metrics, spec, token, tls))
        records.write(MetricsRecord(time=time.time(), url=scrapes.url))
        # The coordinator holds checkpoints' dense state and manifests, wherever this runs.
        coordinator = CoordinatorClient(peers.oracle, token=token, transport=spec.cluster.transport,
                                        reconnect_s=spec.cluster.reconnect_s, tls=tls)
        # Read once: the PS client checks that every shard holds it, the engine loads its dense part.
        resumed_from = io.run(coordinator.resumed_from()) if resume else None
        if not local:
            # The journal lets a PS shard restart alone (from its snapshot) while this trainer
            # waits; without checkpoints there is no snapshot, so nothing is kept. Its rank
            # lets it tell such a shard it has replayed: the shard serves fetches once all have.
            client = dict(
                endpoints=peers.ps, token=token, dim=job.dim, state_width=job.state_width,
                transport=spec.cluster.transport, timeout_s=spec.cluster.request_timeout_s,
                retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
                journal_bytes=spec.checkpoint.journal_bytes if spec.checkpoint.every else 0,
                resumed_from=-1 if resumed_from is None else resumed_from,
                trainer=rank, trainers=world, tls=tls, coordinator=peers.oracle if peers.joined else None,
                term=0 if presence is None else presence.term,
            )
            if helper is not None:
                helper.rows.open(client, timeout=spec.cluster.request_timeout_s)
                ps_client = helper
            else:
                ps_client = PsClient(**client)
        if ps_client is not None and spec.checkpoint.every:
            watcher = io.submit(ps_client.watch_restarts(RESTART_WATCH_S))
        if presence is not None:
            # Whatever the training thread waits for (a collective, a fetch), the term's end
            # ends this process: the next term starts from a checkpoint, as after a kill.
            present = io.submit(coordinator.watch(spec.cluster.reconnect_s, PRESENCE_EVERY_S, presence=presence))
            present.add_done_callback(lambda done: done.cancelled() or start_next_term(presence, done.exception()))
        checkpoints = Checkpointer(job, rank, io, ps_client, coordinator, records,
                                   on_regrouped=None if presence is None else partial(start_next_term, presence))
        rows = (helper.rows if helper is not None else None if ps_client is None
                else RemoteRows(io, ps_client, wait_s=spec.cluster.fetch_timeout_s))
        engine = build_engine(job, device, comm, rows, model, on_checkpoint_written=checkpoints.report)
        start = resume_point(job, engine, io, coordinator, resumed_from) if resume else 0
        if presence is not None:
            records.write(TermRecord(term=presence.term, trainers=world, first_iteration=start, time=time.time()))
        stream = DirectiveStream(
            io, peers.oracle, token=token, transport=spec.cluster.transport, trainer=rank,
            start=start, retries=spec.cluster.retries, reconnect_s=spec.cluster.reconnect_s,
            timeout_s=spec.cluster.fetch_timeout_s, tls=tls,
        )
        oracle = OracleLink(endpoint=peers.oracle, token=token, transport=spec.cluster.transport,
                            timeout_s=spec.cluster.request_timeout_s, retries=spec.cluster.retries,
                            reconnect_s=spec.cluster.reconnect_s, tls=tls)
        clock = ThreadClock()
        cpu_of_threads = clock if helper is None else lambda: {**clock(), **helper_cpu("ps-client", helper.pid)}
        iterations = _train(job, engine, stream, comm, records, checkpoints, metrics, cpu_of_threads)
        engine.drain()
        comm.close()  # every background sum was applied by the drain
        stream.close()
        checkpoints.wait()
        comm.barrier()  # every trainer's write-backs are acknowledged: the PS holds the model
        held_out = eval_batches(io, oracle, rank)
        finish_run(job, rank, engine, comm, io, ps_client, records, run_dir, iterations, held_out)
        # Leave together: trainers that left while rank 0 still saved the final model aborted
        # in gloo at exit in 2 of 32 T = 4 runs (see also launch.py on how a trainer exits).
        comm.barrier()
        metrics.finish()
        if spec.cluster.metrics_linger_s and not metrics.wait_final_read(spec.cluster.metrics_linger_s):
            log.info("no scrape read the final metrics within metrics_linger_s = %g s", spec.cluster.metrics_linger_s)
        report_finished(io, oracle, rank)
    except RuntimeError as exc:  # gloo's error names no peer and no setting: say which and why
        unreachable = peers_unreachable(exc, rank, world, spec.cluster.request_timeout_s * 4)
        if unreachable is None:
            raise
        raise unreachable from exc
    finally:
        # Also after a failure: nothing may keep the process alive (the launcher waits for
        # it to exit to report the error), so no step here can block for long.
        if watcher is not None:
            watcher.cancel()
        if present is not None:
            present.cancel()
        if isinstance(ps_client, PsClient):
            with contextlib.suppress(Exception):
                io.run(ps_client.close(), timeout=5)
        if helper is not None:
            helper.close(timeout_s=5)
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

    left = _left_term(environ)

    async def join() -> Joined | None:
        try:
            return await coordinator.join("trainer", None if left else index, Endpoint(host=host, port=0), left=left)
        except Conflict as exc:
            if not exc.fields.get("finished"):
                raise
            log.info("%s: nothing to do", exc.message)  # a spare of an elastic job that ended
            return None
        finally:
            await coordinator.close()

    joined = run(join())
    if joined is None:
        return
    configure_logging(f"trainer[{joined.index}]")
    job = joined.job(coordinator.endpoint)
    elastic = job.spec.trainers.elastic
    if torchrun and elastic:
        raise ConfigError("trainers.min_count", "an elastic job's trainers meet at the coordinator's store, "
                                                "whose membership changes at each regroup: start them without torchrun")
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
        rendezvous = Rendezvous(store=store, prefix=f"bagpipe/t{joined.term}/{joined.generation}/")
    peers = Peers(oracle=coordinator.endpoint, ps=joined.ps, rendezvous=rendezvous, joined=True)
    tls = None if coordinator.tls is None else coordinator.tls.following(job.spec.cluster.tls)
    presence = Presence(role="trainer", index=joined.index, term=joined.term) if elastic else None
    try:
        # A trainer follows the coordinator: it resumes when the run does.
        run_trainer(job, joined.index, token=token, peers=peers, run_dir=run_dir or Path("runs") / job.spec.name,
                    resume=resume or joined.resumed_from is not None, tls=tls, presence=presence)
    except Exception as exc:
        if presence is None:
            raise
        log.exception("trainer %d cannot go on in term %d", joined.index, joined.term)
        reporter = CoordinatorClient(coordinator.endpoint, token=token, transport=job.spec.cluster.transport,
                                     tls=coordinator.tls)
        start_next_term(presence, exc, coordinator=reporter)


def _left_term(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(term, index) this process had before it started again for an elastic job's next term."""
    raw = environ.get(LEFT_TERM_ENV)
    if not raw:
        return None
    term, _, index = raw.partition(":")
    if not (term.isdigit() and index.isdigit()):
        raise ConfigError(LEFT_TERM_ENV, f"must be TERM:INDEX, got {raw!r}")
    return int(term), int(index)


def start_next_term(presence: Presence, failure: BaseException | None,
                    coordinator: CoordinatorClient | None = None) -> NoReturn:
    """End this trainer's term: tell the coordinator why, if it failed (the job regroups at
    once), then start again as a fresh process that registers for the next term."""
    if coordinator is not None and failure is not None and not isinstance(failure, Regrouped):
        reason = f"{type(failure).__name__}: {failure}".splitlines()[0]

        async def report() -> None:
            with contextlib.suppress(Exception):
                await coordinator.present(dataclasses.replace(presence, failure=reason), timeout=5)
            await coordinator.close()

        with contextlib.suppress(Exception):
            run(report())
    restart_process(drop=NEXT_TERM_DROPS,
                    env={LEFT_TERM_ENV: f"{presence.term}:{presence.index}"})


def _train(
    job: Job, engine: Engine, stream: DirectiveStream, comm: Collectives, records: RecordWriter,
    checkpoints: Checkpointer, metrics: TrainerMetrics, cpu_of_threads: Callable[[], dict[str, float]],
) -> int:
    spec = job.spec
    row_bytes = 4 * (job.dim + job.state_width)
    dense_bytes = dense_gradient_bytes(engine.model) if comm.world_size > 1 else 0
    progressive = MetricAccumulator()
    waited = time.perf_counter()
    engine.timer.restart()
    for step in stream:
        engine.timer.add("wait_directive", time.perf_counter() - waited)
        stats = engine.step(step.directive, step.labels, step.dense)
        if step.directive.checkpoint:
            checkpoints.save_dense(stats.iteration, engine)
        record = iteration_record(stats, engine, row_bytes, 4 * job.dim, dense_bytes)
        records.write(record)
        metrics.record(record)
        done = stats.iteration + 1
        if done % THREADS_EVERY == 0:
            records.write(ThreadsRecord(iteration=done, time=time.time(), cpu=cpu_of_threads()))
        if spec.train.eval_every:  # without it the predictions are never scored: keep none
            progressive.add(stats.labels, stats.probs)
            if done % spec.train.eval_every == 0:
                record_eval(records, comm, progressive, done, split="progressive")
                progressive = MetricAccumulator()
        waited = time.perf_counter()
    # The run's length, from the stream's end: a run resumed after its last checkpoint may
    # have no step left to run.
    assert stream.iterations is not None
    return stream.iterations


