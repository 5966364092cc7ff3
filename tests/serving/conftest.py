"""A small real training run (`launcher.inprocess`: the production engine and planner, one
trainer) and its parameters laid out on disk as a cluster leaves them: as a checkpoint (each
PS shard's snapshot of the rows training wrote, trainer 0's dense state, the manifest) and
as a local-mode run's final model. The multi-process cluster that writes these itself is in
`test_end_to_end.py` (slow)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from common.checkpoints import dense_path, final_paths, ps_dir, write_manifest
from common.init import initial_rows
from common.job import Job, build_job
from common.spec import load_spec
from launcher.inprocess import FinalModel, run_in_process
from ps.checkpoint import save_snapshot
from ps.store import Snapshot
from tests.cluster_helpers import write_spec

#: One trainer, two PS shards; tables of 50..5,000 rows of dim 8 (BASE of cluster_helpers).
OVERRIDES: dict[str, dict[str, Any]] = {"trainers": {"count": 1}, "train": {"max_iterations": 12}}
CHECKPOINT = 11


@dataclass(frozen=True)
class Layout:
    """A job whose checkpoint directory and run folder hold `model` as a cluster leaves them."""

    job: Job
    model: FinalModel
    run_dir: Path


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> FinalModel:
    job = job_in(tmp_path_factory.mktemp("trained"))
    return run_in_process(job).model


def job_in(directory: Path, overrides: dict[str, dict[str, Any]] = OVERRIDES) -> Job:
    """The test job with its checkpoint directory in `directory`."""
    return build_job(load_spec(write_spec(directory, "export", overrides)))


@pytest.fixture
def checkpointed(tmp_path: Path, trained: FinalModel) -> Layout:
    job = job_in(tmp_path)
    save_checkpoint(job, trained, CHECKPOINT)
    return Layout(job=job, model=trained, run_dir=tmp_path / "run")


@pytest.fixture
def local_run(tmp_path: Path, trained: FinalModel) -> Layout:
    job = job_in(tmp_path)
    save_local_final(tmp_path / "run", trained, iterations=CHECKPOINT + 1)
    return Layout(job=job, model=trained, run_dir=tmp_path / "run")


def save_checkpoint(job: Job, model: FinalModel, c: int) -> None:
    """Checkpoint `c` of `model`: each shard's snapshot holds the rows that differ from their
    initial value (what training wrote), saved as the PS saves one; then the dense state as
    trainer 0 saves it, and the manifest."""
    spec, layout, shards = job.spec, job.layout, job.spec.ps.num_shards
    keys = np.arange(layout.total_rows, dtype=np.int64)
    written = keys[(model.table != initial_rows(layout, spec.seed, keys, job.dim)).any(axis=1)]
    for s in range(shards):
        mine = written[written % shards == s]
        snap = Snapshot(local=mine // shards, rows=model.table[mine], state=model.state[mine],
                        versions=np.full(len(mine), c, np.int64))
        save_snapshot(ps_dir(spec.checkpoint.dir, s), c, snap, {"shard": s, "num_shards": shards})
    dense = dense_path(spec.checkpoint.dir, c)
    dense.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.dense, "optimizer": {}, "iteration": c}, dense)
    write_manifest(spec.checkpoint.dir, c, shards, {})


def save_local_final(run_dir: Path, model: FinalModel, *, iterations: int) -> None:
    """A local-mode run's final model: the whole table beside the dense state, info last."""
    paths = final_paths(run_dir)
    paths.dense.parent.mkdir(parents=True)
    torch.save(model.dense, paths.dense)
    np.save(paths.table, model.table)
    np.save(paths.state, model.state)
    paths.info.write_bytes(orjson.dumps({"iterations": iterations, "ps_checkpoint": None}))


def table_slices(job: Job, table: np.ndarray) -> list[np.ndarray]:
    """The full ``[total_rows, d]`` table cut into its tables."""
    offsets = job.layout.offsets
    return [table[offsets[t] : offsets[t + 1]] for t in range(job.layout.num_tables)]
