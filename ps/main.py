"""Entry point of one PS shard process: `python launch.py SPEC --role ps --index N`."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from common.addresses import listen_on, serve_address
from common.checkpoints import latest_complete
from common.errors import ConfigError, Regrouped
from common.job import Job
from common.runtime import (
    NEXT_TERM_DROPS,
    configure_logging,
    first_of,
    make_servers,
    restart_process,
    wait_for_stop_signal,
    write_ready_file,
)
from common.spec import Endpoint
from common.transport import Tls
from oracle.coordinator_client import PRESENCE_EVERY_S, CoordinatorClient
from oracle.protocol import Presence
from ps.checkpoint import remove_after, remove_leftovers
from ps.relaunch import shard_command
from ps.startup import build_service, restore_checkpoint, restore_own_latest, start_fresh

log = logging.getLogger(__name__)


async def run_ps(
    job: Job,
    index: int,
    *,
    token: str,
    resume: bool,
    ready_file: Path | None,
    rejoin: bool = False,
    fresh: bool = False,
    admin_port: int | None = None,
    address: Endpoint | None = None,
    coordinator: CoordinatorClient | None = None,
    resumed_from: int | None = None,
    listener: socket.socket | None = None,
    tls: Tls | None = None,
    presence: Presence | None = None,
) -> None:
    """Serve shard `index` on `address` (default: the spec's) until the run's final snapshot
    is saved (then it exits by itself, so a batch job completes), or SIGTERM/SIGINT, or
    `coordinator` is unreachable for `cluster.reconnect_s`.

    With `resume`, it starts from the latest complete checkpoint of the cluster, like every
    other role, and deletes its snapshots newer than that (an abandoned run's). With
    `rejoin` it was restarted alone while the others run on: it comes back with its own
    latest snapshot, and each trainer replays to it the write-backs that snapshot lacks
    (`ps.client`). It answers no fetch until every trainer has replayed and said so: before,
    the snapshot's older copy of a row whose newest write-back is still in a journal could be
    served to a fetch that asks for any version. Otherwise it starts empty, which is right
    only for a new run: with snapshots on its disk (a run that may still be going on) it
    refuses to start unless `fresh` says to delete them (`start_fresh`). `listener`: a
    socket already listening on `address`, which the shard then serves. `tls`: both its
    servers speak TLS only.
    """
    spec = job.spec
    if not 0 <= index < spec.ps.num_shards:
        raise SystemExit(f"--index {index} is outside 0..{spec.ps.num_shards - 1}")
    if fresh and (resume or rejoin):
        raise ConfigError("--fresh", "starts a new run: it cannot be combined with --resume or --rejoin")
    service = build_service(job, index, rejoin=rejoin)
    service.term = 0 if presence is None else presence.term
    remove_leftovers(service.checkpoint_dir)
    if rejoin:
        restore_own_latest(service)
        log.info("restarted alone: the trainers replay what this snapshot lacks; no fetch is "
                 "served until all %d have", spec.trainers.count)
    elif resume:
        # Joined, the coordinator says where the run resumes: its manifests are on its machine.
        start = latest_complete(spec.checkpoint.dir, spec.ps.num_shards) if coordinator is None else resumed_from
        gone = remove_after(service.checkpoint_dir, -1 if start is None else start)
        if gone:
            log.warning("removed snapshots %s, newer than the latest complete checkpoint %s", gone, start)
        restore_checkpoint(service, start, reshard=True)
    else:
        joined_at = None if coordinator is None else coordinator.endpoint
        start_fresh(service, index, delete=fresh, command=shard_command(index, joined_at, address))
    address = address or spec.ps.addresses[index]
    servers = make_servers(spec.cluster, service.router(), address, token=token, admin_port=admin_port,
                           sock=listener, tls=tls)
    for server in servers:
        await server.start()
    info = {
        "role": "ps",
        "index": index,
        "host": address.host,
        "port": servers[0].port,
        "http1_port": servers[-1].port,
        "rows": service.store.num_rows,
    }
    log.info("PS shard %d/%d serving %s%s on %s:%d (HTTP/1.1 on port %d), %d rows of dim %d",
             index, spec.ps.num_shards, spec.cluster.transport, " over TLS" if tls else "", address.host, info["port"],
             info["http1_port"], service.store.num_rows, job.dim)
    write_ready_file(ready_file, info)
    try:
        ends = [wait_for_stop_signal(), service.finished.wait()]
        if coordinator is not None:
            every_s = 2.0 if presence is None else PRESENCE_EVERY_S
            ends.append(coordinator.watch(spec.cluster.reconnect_s, every_s, presence=presence))
        await first_of(*ends)
        if service.finished.is_set():
            linger = spec.cluster.metrics_linger_s
            if linger and not await service.final_scrape.wait(linger):
                log.info("no scrape read the final metrics within metrics_linger_s = %g s", linger)
            log.info("the run's final snapshot is saved: PS shard %d exits", index)
    finally:
        for server in servers:
            await server.stop()


async def join_and_run_ps(
    coordinator: CoordinatorClient, *, token: str, index: int | None, bind: Endpoint | None,
    ready_file: Path | None, resume: bool = False, rejoin: bool = False, fresh: bool = False,
    admin_port: int | None = None,
) -> None:
    """A shard that knows only the coordinator: listen, register, learn the job, serve (over
    TLS when the coordinator's client speaks it: with the same files, mutual if the job is).

    It listens before it registers: the coordinator checks that the address it registers
    answers, and the port is its own from then on (none other can take it meanwhile)."""
    address = await serve_address(bind, coordinator.endpoint)
    listener = listen_on(address)
    try:
        if address.port == 0 and admin_port is None:  # port + 1 may be taken: any free one
            admin_port = 0
        address = Endpoint(host=address.host, port=listener.getsockname()[1])
        joined = await coordinator.join("ps", index, address)
        configure_logging(f"ps[{joined.index}]")
        job = joined.job(coordinator.endpoint)
        # A shard follows the coordinator: it resumes when the run does, from the same checkpoint.
        resume = resume or (joined.resumed_from is not None and not rejoin)
        if joined.term and joined.resumed_from is None:  # an elastic job regrouped before its first checkpoint
            resume, rejoin, fresh = False, False, True
        tls = None if coordinator.tls is None else coordinator.tls.following(job.spec.cluster.tls)
        elastic = job.spec.trainers.elastic
        presence = Presence(role="ps", index=joined.index, term=joined.term) if elastic else None
        try:
            await run_ps(job, joined.index, token=token, resume=resume, ready_file=ready_file, rejoin=rejoin,
                         fresh=fresh, admin_port=admin_port, address=address, coordinator=coordinator,
                         resumed_from=joined.resumed_from, listener=listener, tls=tls, presence=presence)
        except Regrouped as exc:
            log.warning("%s: this shard starts again for the next term", exc.message)
            listener.close()
            restart_process(drop=NEXT_TERM_DROPS, add=("--index", str(joined.index)), env={})
    finally:
        listener.close()  # closed by its server already, when one served it


