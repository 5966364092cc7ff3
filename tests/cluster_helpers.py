"""Run real local clusters in tests and read back their final parameters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.checkpoints import FinalPaths, final_paths
from common.init import initial_rows
from common.job import Job, build_job
from common.spec import load_spec, spec_toml
from launcher.cluster import ClusterResult, run_cluster
from launcher.inprocess import FinalModel
from oracle.startup import build_workload
from ps.checkpoint import load_snapshot
from tests.trainer.reference import ReferenceResult, reference_train
from trainer.optim import build_embedding_optimizer

TOKEN = "cluster-test-token"

BASE: dict[str, dict[str, Any]] = {
    "cluster": {"transport": "h2", "request_timeout_s": 60, "fetch_timeout_s": 60},
    "oracle": {"mode": "bagpipe", "lookahead": 6, "prefetch_lead": 2, "cache_rows": 100},
    "ps": {"shards": 2},
    "trainers": {"count": 2},
    "data": {
        "format": "synthetic", "rows": 2200, "table_sizes": [50, 200, 1000, 5000], "num_dense": 4,
        "top1_share": 0.5, "eval_fraction": 0.1, "seed": 1,
    },
    "model": {"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
    "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.1, "dense": "sgd", "dense_lr": 0.05},
    "train": {"batch_size": 32, "epochs": 1, "max_iterations": 60},
}


def write_spec(
    directory: Path, name: str, overrides: dict[str, dict[str, Any]], seed: int = 7, *,
    data: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
) -> Path:
    """A spec of BASE with `overrides` merged into its sections; `data` replaces `[data]`,
    `model` replaces `[model]`."""
    sections = {key: dict(value) for key, value in BASE.items()}
    for key, value in overrides.items():
        sections.setdefault(key, {}).update(value)
    for key, replacement in (("data", data), ("model", model)):
        if replacement is not None:
            sections[key] = dict(replacement)
    sections["checkpoint"] = {"dir": str(directory / "checkpoints"), **sections.get("checkpoint", {})}
    path = directory / f"{name}.toml"
    path.write_text(spec_toml(name, seed, sections))
    return path


def run_spec(path: Path, run_dir: Path, *, resume: bool = False) -> tuple[Job, ClusterResult]:
    job = build_job(load_spec(path))
    return job, run_cluster(job, run_dir, token=TOKEN, resume=resume)


def final_model(job: Job, run_dir: Path) -> FinalModel:
    """The parameters a run ended with: dense from rank 0, tables from the PS (or local)."""
    final = final_paths(run_dir)
    dense = torch.load(final.dense)
    if job.spec.oracle.mode == "local":
        return FinalModel(dense, np.load(final.table), np.load(final.state))
    layout, spec = job.layout, job.spec
    keys = np.arange(layout.total_rows, dtype=np.int64)
    table = initial_rows(layout, spec.seed, keys, job.dim)
    state = build_embedding_optimizer(job.optimizer).initial_state(layout.total_rows).numpy()
    iterations = _iterations(final)
    for shard in range(spec.ps.num_shards):
        snap, _ = load_snapshot(spec.checkpoint.dir / f"ps-{shard}", iterations)
        global_keys = snap.local * spec.ps.num_shards + shard
        table[global_keys] = snap.rows
        state[global_keys] = snap.state
    return FinalModel(dense, table, state)


def _iterations(final: FinalPaths) -> int:
    import orjson

    return int(orjson.loads(final.info.read_bytes())["iterations"])


def reference_for(job: Job, slices: int | Callable[[int], int] | None = None) -> ReferenceResult:
    """The data-parallel reference of `job` (`slices` defaults to its trainer count; a
    function gives each iteration's)."""
    workload = build_workload(job)
    batches = (
        (torch.from_numpy(labels.copy()), torch.from_numpy(dense.copy()), torch.from_numpy(keys))
        for keys, labels, dense in workload.key_batches()
    )
    slices = job.spec.trainers.count if slices is None else slices
    return reference_train(job.model, job.optimizer, job.layout, job.spec.seed, batches, job.num_dense, slices)


def as_final(result: ReferenceResult) -> FinalModel:
    return FinalModel(result.dense_state, result.table.numpy(), result.state.numpy())


def differing_elements(got: FinalModel, want: FinalModel) -> dict[str, int]:
    """Per tensor, how many elements differ (an empty dict: bit-identical, -0.0 == 0.0)."""
    pairs = [(f"dense {name}", got.dense[name].numpy(), t.numpy()) for name, t in want.dense.items()]
    pairs += [("embedding rows", got.table, want.table), ("optimizer state", got.state, want.state)]
    out = {}
    for what, have, expected in pairs:
        if have.shape != expected.shape:
            raise AssertionError(f"{what}: shape {have.shape} != {expected.shape}")
        count = int(np.count_nonzero(have != expected))
        if count:
            out[what] = count
    return out


def assert_identical(got: FinalModel, want: FinalModel) -> None:
    differing = differing_elements(got, want)
    assert not differing, f"not bit-identical: {differing}"


def assert_same_model(got: FinalModel, want: ReferenceResult, rtol: float = 1e-5) -> None:
    """Equal within `rtol`, element by element, with an absolute floor of `rtol` times the
    tensor's largest magnitude: float summation order (T partial sums, DDP's average) moves
    near-zero elements by a few ulps of the tensor's scale, not of their own."""
    pairs = [(f"dense {name}", got.dense[name].numpy(), t.numpy()) for name, t in want.dense_state.items()]
    pairs += [("embedding rows", got.table, want.table.numpy()), ("optimizer state", got.state, want.state.numpy())]
    for what, have, expected in pairs:
        floor = rtol * float(np.abs(expected).max(initial=0.0))
        np.testing.assert_allclose(have, expected, rtol=rtol, atol=floor, err_msg=what)
