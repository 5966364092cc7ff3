"""What a trainer records as it trains: each iteration's record from the engine's counts, and
evaluations scored once over every trainer's predictions."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from trainer.collectives import Collectives
from trainer.engine import Engine, IterationStats
from trainer.evaluation import MetricAccumulator, evaluate
from trainer.records import EvalRecord, IterationRecord, RecordWriter

log = logging.getLogger(__name__)


def dense_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of dense gradients DDP all-reduces each iteration (float32 parameters)."""
    return sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def iteration_record(
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
        machinery_cpu=engine.timer.machinery_cpu,
    )


def record_eval(records: RecordWriter, comm: Collectives, acc: MetricAccumulator, iteration: int, *, split: str) -> None:
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
