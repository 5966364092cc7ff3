"""Entry point of the oracle process: `python launch.py SPEC --role oracle`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import signal
from functools import partial
from pathlib import Path

import orjson

from common.checkpoints import latest_complete
from common.files import write_atomically
from common.job import Job
from common.prometheus import Registry
from common.runtime import first_of, make_servers, wait_for_stop_signal, write_ready_file
from common.spec import Endpoint, with_trainer_count
from common.transport import Router, Tls
from oracle.compiled import compile_planner
from oracle.coordinator_service import Coordinator
from oracle.exporter import Exporter
from oracle.membership import RegroupFailed
from oracle.protocol import HEALTH, OracleHealth, add_handlers
from oracle.service import OracleService
from oracle.stream import STREAM_SUMMARY, SegmentLog, stream_folder
from oracle.startup import build_workload, planner_config

log = logging.getLogger(__name__)


async def run_oracle(
    job: Job, *, token: str, ready_file: Path | None, resume: bool = False, first_iteration: int | None = None,
    admin_port: int | None = None, tls: Tls | None = None, until: int | None = None,
) -> None:
    """Plan and serve the directive streams, and coordinate the job (`oracle.coordinator_service`),
    until every trainer has finished (then it exits by itself, so a batch job completes) or
    SIGTERM; with `resume`, from the iteration after the latest complete checkpoint. Over
    h2, the routes are also served over HTTP/1.1 on `admin_port`
    (`common.runtime.make_servers`), for Prometheus; with `tls`, both speak TLS only.

    An oracle restarted alone is given `first_iteration`, where the running trainers started:
    the plan is a pure function of the data from there, so replanning from it gives the
    trainers (which keep their caches) the very steps they would have had, from wherever
    each one reconnects.

    An elastic job runs in terms (`oracle.membership`): at each regroup the oracle stops
    planning, and plans again from the checkpoint the next term resumes from, for its
    trainers; its servers, its coordinator and the trainers' store stay up throughout.

    A stream (`data.watch`) trains until `until` (``--until``) or `train.max_iterations`, or
    until it is stopped: SIGTERM (or ``POST /v1/stop``) ends it at its next checkpoint, a
    second SIGTERM, or SIGINT, at once (docs/design.md#online-training).
    """
    spec = job.spec
    restarted_alone = first_iteration is not None
    if first_iteration is None:
        checkpoint = latest_complete(spec.checkpoint.dir, spec.ps.num_shards) if resume else None
        first_iteration = 0 if checkpoint is None else checkpoint + 1
    if not resume and not restarted_alone and job.data.watch:
        # a fresh run reads its stream from the start, in the order parts come now
        shutil.rmtree(stream_folder(spec.checkpoint.dir), ignore_errors=True)
    planning = Planning(job, first_iteration, restarted_alone=restarted_alone, until=until)
    address = spec.oracle.address
    if spec.export.enabled and not resume and not restarted_alone:
        Exporter.start_fresh(job)
    exporter = Exporter(job) if spec.export.enabled else None
    coordinator = Coordinator(job, start_store=lambda: trainer_store(address.host),
                              resumed_from=first_iteration - 1 if first_iteration else None,
                              metrics=planning.service.metrics, exporter=exporter)
    router = planning.router(coordinator)
    coordinator.add_routes(router)
    servers = make_servers(spec.cluster, router, address, token=token, admin_port=admin_port, tls=tls)
    for server in servers:
        await server.start()
    planning.service.start()
    config, workload = planning.service.config, planning.service.workload
    log.info("oracle (%s, L=%d, D=%d, C=%d) serving %d iterations on %s:%d (HTTP/1.1 on port %d)%s",
             config.mode, config.lookahead, config.prefetch_lead, config.capacity,
             workload.num_iterations, address.host, servers[0].port, servers[-1].port, " over TLS" if tls else "")
    write_ready_file(ready_file, {"role": "oracle", "host": address.host, "port": servers[0].port,
                                  "http1_port": servers[-1].port, "iterations": workload.num_iterations})
    membership = asyncio.create_task(coordinator.watch_membership())
    try:
        while True:
            service = planning.service
            assert service.failed is not None
            stop_signal = asyncio.ensure_future(wait_for_stop_signal())
            await first_of(stop_signal, asyncio.shield(service.failed), coordinator.finished.wait(),
                           coordinator.regrouping.wait(), coordinator.failed.wait())
            if coordinator.failure is not None:
                raise SystemExit(f"oracle: {coordinator.failure}")
            if coordinator.regrouping.is_set() and not coordinator.finished.is_set():
                try:
                    await planning.regroup(coordinator)
                except RegroupFailed as exc:
                    raise SystemExit(f"oracle: {exc}") from None
                continue
            if service.failed.done():
                raise SystemExit(f"oracle: the planner failed: {service.failed.result()!r}")
            if coordinator.finished.is_set():
                if exporter is not None:  # the chain ends with the run's last checkpoint
                    last = latest_complete(spec.checkpoint.dir, spec.ps.num_shards)
                    if last is not None:
                        await asyncio.to_thread(exporter.offer, last, final=True)
                service.final_scrape.finish()
                linger = spec.cluster.metrics_linger_s
                if linger and not await service.final_scrape.wait(linger):
                    log.info("no scrape read the final metrics within metrics_linger_s = %g s", linger)
                log.info("every trainer has finished: the oracle exits")
                return
            graceful = stop_signal.done() and not stop_signal.cancelled() and stop_signal.result() == signal.SIGTERM
            if graceful and service.is_stream and not service.stopping:
                service.request_stop()  # the trainers finish the stream; the oracle exits with them
                continue
            return
    finally:
        membership.cancel()
        if exporter is not None and not exporter.wait_idle(60):
            log.warning("an export was still being written as the oracle stopped")
        if planning.service.is_stream:  # also when stopped: the launcher stops it as the trainers end
            summary = planning.service.stream_summary()
            write_atomically(stream_folder(spec.checkpoint.dir) / STREAM_SUMMARY,
                             orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        planning.service.stop()
        for server in servers:
            await server.stop()


class Planning:
    """The planner service of the current term, behind routes that stay: a regroup replaces
    the service (`regroup`), not the servers."""

    def __init__(self, job: Job, first_iteration: int, *, restarted_alone: bool = False,
                 metrics: Registry | None = None, every_count: bool = True, until: int | None = None) -> None:
        """`every_count`: check the capacity rule at every trainer count an elastic job may
        come to (at start-up; a regroup's count was among them). `until`: a stream's end."""
        self.until = until
        workload = build_workload(job, start=first_iteration, until=until)
        config = planner_config(job, workload, every_count=every_count)
        compile_planner(config.mode)  # before it reports ready: trainers then never wait on numba
        segments = SegmentLog(stream_folder(job.spec.checkpoint.dir)) if job.data.watch else None
        export_dir = job.spec.export.dir if job.spec.export.enabled else None
        self.service = OracleService(config, workload, max_ahead=job.spec.oracle.max_ahead,
                                     restarted_alone=restarted_alone, registry=metrics, segment_log=segments,
                                     export_dir=export_dir)

    def router(self, coordinator: Coordinator) -> Router:
        """`OracleService`'s routes, each served by whichever service is current; the health
        says the coordinator's term too."""
        router = Router()
        handlers = {route: partial(self._serve, name) for route, name in OracleService.HANDLERS.items()}
        add_handlers(router, {**handlers, HEALTH: lambda _: self._health(coordinator)})
        return router

    def _serve(self, name: str, message: object) -> object:
        return getattr(self.service, name)(message)

    async def _health(self, coordinator: Coordinator) -> OracleHealth:
        health = await self.service.health(None)
        return dataclasses.replace(health, term=coordinator.term)

    async def regroup(self, coordinator: Coordinator) -> None:
        """Stop planning; once the regroup is decided, plan its term."""
        old = self.service
        old.stop()  # its streams end: the trainers of the ending term start again
        decision = await coordinator.next_term()
        job = dataclasses.replace(coordinator.job, spec=with_trainer_count(coordinator.job.spec,
                                                                            decision.term.trainers))
        first = 0 if decision.term.resumed_from is None else decision.term.resumed_from + 1
        following = await asyncio.to_thread(Planning, job, first, metrics=old.metrics, every_count=False,
                                            until=self.until)
        self.service = following.service
        self.service.start()
        coordinator.begin_term(job, decision)


def trainer_store(host: str) -> tuple[object, Endpoint]:
    """A store where the trainers' process group meets (`trainer.collectives.Rendezvous`), on
    a free port of the oracle's host: the store (keep it alive) and its address. torch is
    imported only here, when a trainer joins through the coordinator."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return store, Endpoint(host=host, port=store.port)
