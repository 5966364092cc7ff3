"""Entry point of the oracle process: `python launch.py SPEC --role oracle`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from common.checkpoints import latest_complete
from common.data.dataset import open_dataset
from common.errors import ConfigError
from common.job import Job
from common.runtime import first_of, make_servers, wait_for_stop_signal, write_ready_file
from common.spec import Endpoint
from common.transport import Tls
from oracle.compiled import compile_planner
from oracle.config import PlannerConfig, capacity_bound, hottest_keys, required_capacity
from oracle.coordinator_service import Coordinator
from oracle.service import OracleService, Workload

log = logging.getLogger(__name__)


def build_workload(job: Job, start: int = 0) -> Workload:
    train = job.spec.train
    return Workload(
        dataset=open_dataset(job.data, progress=True),
        layout=job.layout,
        batch_size=train.batch_size,
        epochs=train.epochs,
        max_iterations=train.max_iterations,
        start=start,
    )


def planner_config(job: Job, workload: Workload) -> PlannerConfig:
    """The planner's parameters from the spec; fails at start-up when C cannot work."""
    check_capacity(job)
    config = PlannerConfig(**_planner_fields(job, workload.start))
    if config.mode != "static-cache":
        return config
    # FAE-style: pin the hottest rows, keep room for one iteration's other rows.
    count = config.capacity - capacity_bound(config, workload.batch_size, job.layout.num_tables)
    # The hot set of the whole run, also when resuming: the plan does not depend on where it starts.
    hot = hottest_keys((keys for keys, _, _ in dataclasses.replace(workload, start=0).key_batches()), count)
    log.info("static cache pins the %d hottest rows", len(hot))
    return dataclasses.replace(config, hot_keys=np.sort(hot))


def check_capacity(job: Job) -> None:
    """The capacity rule (DESIGN §4 rule 4, §8): ConfigError naming `oracle.cache_rows` and
    the C this run needs. The launcher calls it before it starts any role, the oracle before
    it plans; it judges the whole run, also when resuming, so that both always agree.

    static-cache needs room for one iteration's rows besides at least one pinned row; the
    other caching modes need each trainer's distinct rows of any one iteration, which the
    safe bound (B/T) x F answers without reading the data, and a pass over it otherwise.
    With P planner workers each worker's share of C must hold its keys' part of them: the
    safe bound is P x (B/T) x F, and the pass finds P x the largest part.
    """
    config = PlannerConfig(**_planner_fields(job, 0))  # checks each field (C where used)
    bound = capacity_bound(config, job.spec.train.batch_size, job.layout.num_tables)  # and B
    if config.mode == "local":
        return
    if config.mode == "static-cache":
        if config.capacity <= bound:
            raise ConfigError(
                "oracle.cache_rows",
                f"C = {config.capacity} leaves no row to pin: static-cache keeps room for one "
                f"iteration's other rows ((B/T) x F = {bound}), so it needs C >= {bound + 1}",
            )
        return
    if config.capacity >= config.workers * bound:
        return
    need = required_capacity(config, (keys for keys, _, _ in build_workload(job).key_batches()))
    if config.capacity < need:
        workers = f" with oracle.planner_workers = {config.workers}" if config.workers > 1 else ""
        raise ConfigError(
            "oracle.cache_rows",
            f"C = {config.capacity} cannot hold one iteration's rows{workers}: this data needs C >= {need}",
        )


def _planner_fields(job: Job, first_iteration: int) -> dict[str, Any]:
    """PlannerConfig's fields from the spec, without the static cache's hot set."""
    spec = job.spec
    return dict(
        num_trainers=spec.trainers.count,
        lookahead=spec.oracle.lookahead,
        prefetch_lead=spec.oracle.prefetch_lead,
        capacity=spec.oracle.cache_rows,
        mode=spec.oracle.mode,
        workers=spec.oracle.planner_workers,
        checkpoint_every=spec.checkpoint.every,
        total_rows=job.layout.total_rows,
        first_iteration=first_iteration,
    )


async def run_oracle(
    job: Job, *, token: str, ready_file: Path | None, resume: bool = False, first_iteration: int | None = None,
    admin_port: int | None = None, tls: Tls | None = None,
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
    """
    spec = job.spec
    restarted_alone = first_iteration is not None
    if first_iteration is None:
        checkpoint = latest_complete(spec.checkpoint.dir, spec.ps.num_shards) if resume else None
        first_iteration = 0 if checkpoint is None else checkpoint + 1
    workload = build_workload(job, start=first_iteration)
    config = planner_config(job, workload)
    compile_planner(config.mode)  # before it reports ready: trainers then never wait on numba
    service = OracleService(config, workload, max_ahead=spec.oracle.max_ahead, restarted_alone=restarted_alone)
    address = spec.oracle.address
    coordinator = Coordinator(job, start_store=lambda: trainer_store(address.host),
                              resumed_from=first_iteration - 1 if first_iteration else None)
    router = service.router()
    coordinator.add_routes(router)
    servers = make_servers(spec.cluster, router, address, token=token, admin_port=admin_port, tls=tls)
    for server in servers:
        await server.start()
    service.start()
    log.info("oracle (%s, L=%d, D=%d, C=%d) serving %d iterations on %s:%d (HTTP/1.1 on port %d)%s",
             config.mode, config.lookahead, config.prefetch_lead, config.capacity,
             workload.num_iterations, address.host, servers[0].port, servers[-1].port, " over TLS" if tls else "")
    write_ready_file(ready_file, {"role": "oracle", "host": address.host, "port": servers[0].port,
                                  "http1_port": servers[-1].port, "iterations": workload.num_iterations})
    try:
        assert service.failed is not None
        await first_of(wait_for_stop_signal(), asyncio.shield(service.failed), coordinator.finished.wait())
        if service.failed.done():
            raise SystemExit(f"oracle: the planner failed: {service.failed.result()!r}")
        if coordinator.finished.is_set():
            service.final_scrape.finish()
            linger = spec.cluster.metrics_linger_s
            if linger and not await service.final_scrape.wait(linger):
                log.info("no scrape read the final metrics within metrics_linger_s = %g s", linger)
            log.info("every trainer has finished: the oracle exits")
    finally:
        service.stop()
        for server in servers:
            await server.stop()


def trainer_store(host: str) -> tuple[object, Endpoint]:
    """A store where the trainers' process group meets (`trainer.collectives.Rendezvous`), on
    a free port of the oracle's host: the store (keep it alive) and its address. torch is
    imported only here, when a trainer joins through the coordinator."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return store, Endpoint(host=host, port=store.port)
