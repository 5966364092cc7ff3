"""What a trainer builds from a job: the dense model as every trainer seeds it, and the engine
around it (DDP over the trainers' group, the cache, the optimizers)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from common.init import initial_rows
from common.job import Job
from trainer.cache import EmbeddingCache
from trainer.collectives import Collectives
from trainer.device import Device
from trainer.engine import CheckpointCallback, Engine, RowSource
from trainer.models import build_model
from trainer.optim import build_dense_optimizer, build_embedding_optimizer
from trainer.timing import PhaseTimer

INIT_CHUNK_ROWS = 1 << 20


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
