"""The end of a run: held-out evaluation with the final parameters, and the final model saved
(rank 0's dense state; the tables from the PS, or from the cache in local mode)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import orjson
import torch

from common.checkpoints import final_paths
from common.errors import BagpipeError
from common.job import Job
from common.steps import EvalBatch
from ps.client import PsClient
from trainer.ps_process import PsProcess
from trainer.collectives import Collectives
from trainer.engine import Engine
from trainer.evaluation import MetricAccumulator
from trainer.io_thread import IoThread
from trainer.records import FinalRecord, RecordWriter
from trainer.reporting import record_eval

log = logging.getLogger(__name__)


def finish_run(job: Job, rank: int, engine: Engine, comm: Collectives, io: IoThread, ps: PsClient | PsProcess | None,
            records: RecordWriter, run_dir: Path, iterations: int, held_out: Iterable[EvalBatch]) -> None:
    """Held-out evaluation and the final model: dense state (rank 0) and the tables."""
    record_eval(records, comm, predict_held_out(held_out, engine), iterations, split="held-out")
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


def predict_held_out(batches: Iterable[EvalBatch], engine: Engine) -> MetricAccumulator:
    """Predictions on this trainer's share of the held-out rows, with the final parameters."""
    acc = MetricAccumulator()
    model = engine.model.module
    model.eval()
    with torch.no_grad():
        for batch in batches:
            # Copies: a decoded message's arrays are read-only views of its bytes.
            emb = _rows_of(batch.keys.copy(), engine)
            dense = torch.tensor(batch.dense, device=engine.device)
            logits = model(dense, emb)
            acc.add(batch.labels, torch.sigmoid(logits).cpu().numpy())
    model.train()
    return acc


def _rows_of(keys: np.ndarray, engine: Engine) -> torch.Tensor:
    if engine.rows is None:  # local mode: the cache holds every row
        return engine.cache.rows[torch.from_numpy(keys).to(engine.device)]
    unique, inverse = np.unique(keys, return_inverse=True)
    got = engine.rows.fetch(unique, np.full(len(unique), -1, dtype=np.int64)).result()
    emb = torch.from_numpy(got.rows[inverse.reshape(keys.shape)]).to(engine.device)
    engine.rows.release(got)
    return emb
