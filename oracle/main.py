"""Entry point of the oracle process: `python launch.py SPEC --role oracle`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from common.checkpoints import latest_complete
from common.job import Job
from common.runtime import first_of, make_servers, wait_for_stop_signal, write_ready_file
from common.spec import Endpoint
from common.transport import Tls
from oracle.compiled import compile_planner
from oracle.coordinator_service import Coordinator
from oracle.service import OracleService
from oracle.startup import build_workload, planner_config

log = logging.getLogger(__name__)


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
