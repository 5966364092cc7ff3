"""How a PS shard starts from a job: its store's configuration, its service, and what it holds
at start-up (empty for a new run, a checkpoint when resuming, its own newest snapshot when
restarted alone)."""

from __future__ import annotations

import logging

from common.checkpoints import ps_dir
from common.errors import Conflict
from common.job import Job
from ps.checkpoint import list_checkpoints, load_snapshot, remove_after, resharded, snapshot_shards
from ps.relaunch import shard_command
from ps.service import PsService
from ps.store import ShardConfig, ShardStore

log = logging.getLogger(__name__)


def shard_config(job: Job, index: int) -> ShardConfig:
    spec = job.spec
    return ShardConfig(
        shard=index,
        num_shards=spec.ps.num_shards,
        layout=job.layout,
        dim=job.dim,
        state_width=job.state_width,
        state_init=job.state_init,
        state_min=job.state_min,
        seed=spec.seed,
        checkpoint_every=spec.checkpoint.every,
        version_limit=job.iterations,
    )


def build_service(job: Job, index: int, *, rejoin: bool = False) -> PsService:
    """Shard `index`'s service; restarted alone (`rejoin`), it holds fetches until each of
    the job's trainers has replayed its journal to it."""
    spec = job.spec
    config = shard_config(job, index)
    return PsService(
        ShardStore(config),
        checkpoint_dir=ps_dir(spec.checkpoint.dir, index),
        fetch_timeout_s=spec.cluster.fetch_timeout_s,
        rejoin_trainers=spec.trainers.count if rejoin else 0,
        num_trainers=spec.trainers.count,
    )


def start_fresh(service: PsService, index: int, *, delete: bool, command: str | None = None) -> None:
    """Shard `index` starts empty, as at iteration 0 of a new run.

    Its snapshots on disk mean a run that may still be going on: the trainers hold rows
    newer than any of them, and an empty shard would lose those (and, once it snapshots,
    make a checkpoint that lost them). So they are deleted only when `delete` (``--fresh``)
    says this is a new run; otherwise Conflict names the commands that recover, starting
    with `command` (`ps.relaunch.shard_command`; default: the spec's form).
    """
    own = list_checkpoints(service.checkpoint_dir)
    command = command or shard_command(index, None, None)
    if own and not delete:
        raise Conflict(
            f"PS shard {index} has snapshots {own} in {service.checkpoint_dir}: they may belong to a run "
            "that is still going on, whose rows an empty shard would lose. Restart it alone while the "
            f"trainers wait with `{command} --rejoin`, or stop every role and start each with --resume; "
            "to begin a new run and delete them, pass --fresh",
            shard=index,
            checkpoints=own,
        )
    gone = remove_after(service.checkpoint_dir, -1)
    if gone:
        log.warning("--fresh: deleted this shard's snapshots %s", gone)


def restore_own_latest(service: PsService) -> None:
    """A shard restarted alone: its own newest snapshot, complete checkpoint or not (its
    clients' journals hold every write since)."""
    own = list_checkpoints(service.checkpoint_dir)
    restore_checkpoint(service, own[-1] if own else None)


def restore_checkpoint(service: PsService, checkpoint_id: int | None, *, reshard: bool = False) -> None:
    """Load checkpoint `checkpoint_id` (None: start empty). With `reshard`, a checkpoint taken
    by another number of shards is read from all of theirs, each row to the shard that now
    owns it (`ps.checkpoint.resharded`): a run may resume with more or fewer shards."""
    if checkpoint_id is None:
        log.info("no complete checkpoint in %s: starting empty", service.checkpoint_dir.parent)
        return
    cfg, root = service.store.config, service.checkpoint_dir.parent
    took = snapshot_shards(root, checkpoint_id)
    if took is not None and took != cfg.num_shards:
        if not reshard:
            raise Conflict(
                f"checkpoint {checkpoint_id} was taken by {took} PS shards and this run has {cfg.num_shards}: "
                "only a resume of every role (--resume) moves its rows to the new shards", checkpoint=checkpoint_id,
            )
        service.restore_snapshot(resharded(root, checkpoint_id, cfg.shard, cfg.num_shards), checkpoint_id)
        log.info("restored checkpoint %d, taken by %d shards: %d rows are this shard's of %d",
                 checkpoint_id, took, service.store.rows_held, cfg.num_shards)
        return
    if checkpoint_id not in list_checkpoints(service.checkpoint_dir):
        raise Conflict(
            f"PS shard {service.store.config.shard} has no snapshot of checkpoint {checkpoint_id} in "
            f"{service.checkpoint_dir}: resume it on the machine, and from the working directory, "
            "that took it (or share [checkpoint] dir between the machines)", checkpoint=checkpoint_id,
        )
    snap, _ = load_snapshot(service.checkpoint_dir, checkpoint_id)
    service.restore_snapshot(snap, checkpoint_id)
    log.info("restored checkpoint %d (%d rows)", checkpoint_id, len(snap.local))
