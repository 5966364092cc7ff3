"""Exactness, in one process (launcher/inprocess.py): every mode, model, optimizer and
trainer count ends with the same parameters, bit for bit, as every other mode and as the
data-parallel reference (tests/trainer/reference.py). Above two trainers that takes the
rank-ordered sums of `trainer.collectives.ordered_sum`, for the embedding gradients and,
through a DDP communication hook, for the dense ones.

The cache (C = 140 / 100 / 60 / 40 rows for T = 1 / 2 / 4 / 8 on 4 tables) is far below the
rows the run touches, so every bagpipe run evicts, joins and re-fetches (asserted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.job import Job, build_job
from common.spec import load_spec
from launcher.inprocess import InProcessRun, run_in_process
from oracle.startup import build_workload
from tests.cluster_helpers import as_final, assert_identical, reference_for, write_spec

MODES = ["bagpipe", "no-cache", "static-cache", "local"]
MODELS = ["dlrm", "deepfm", "wide_deep", "dcn"]
OPTIMIZERS = {
    "adagrad": {"embedding": "rowwise_adagrad", "embedding_lr": 0.1, "dense": "adagrad", "dense_lr": 0.05},
    "sgd": {"embedding": "sgd", "embedding_lr": 0.5, "dense": "sgd", "dense_lr": 0.05},
}
CACHE_ROWS = {1: 140, 2: 100, 4: 60, 8: 40}
#: Iterations of a run: half the base spec's 60 above two trainers, where an in-process
#: iteration costs most (every sum crosses gloo's loopback sockets T (T - 1) times) and the
#: smaller cache still evicts, joins and re-fetches within the first 30 (asserted).
ITERATIONS = {1: 60, 2: 60, 4: 30, 8: 30}


def job_for(tmp_path: Path, *, mode: str, trainers: int, model: str, optimizer: str) -> Job:
    overrides = {
        "oracle": {"mode": mode, "cache_rows": CACHE_ROWS[trainers]},
        "trainers": {"count": trainers},
        "train": {"max_iterations": ITERATIONS[trainers]},
        "model": {"name": model},
        "optimizer": OPTIMIZERS[optimizer],
    }
    if model != "dlrm":
        overrides["model"].update({"deep_mlp": [16, 8], "bottom_mlp": [], "top_mlp": []})
    return build_job(load_spec(write_spec(tmp_path, f"{mode}-{model}-{optimizer}-t{trainers}", overrides)))


def check_every_mode(tmp_path: Path, *, trainers: int, model: str, optimizer: str) -> None:
    runs = {mode: run_in_process(job_for(tmp_path, mode=mode, trainers=trainers, model=model, optimizer=optimizer)) for mode in MODES}
    for mode in MODES[1:]:
        assert_identical(runs[mode].model, runs["bagpipe"].model)
    job = job_for(tmp_path, mode="bagpipe", trainers=trainers, model=model, optimizer=optimizer)
    assert_identical(runs["bagpipe"].model, as_final(reference_for(job)))
    assert_cache_was_exercised(job, runs["bagpipe"])


def assert_cache_was_exercised(job: Job, run: InProcessRun) -> None:
    """Rows were evicted mid-run, fetched again later, reused from the cache, and joined."""
    trainers = job.spec.trainers.count
    stats = [s for per_trainer in run.stats for s in per_trainer]
    last = max(s.iteration for s in stats)
    total = {k: sum(getattr(s, k) for s in stats) for k in ("fetch_rows", "join_rows", "uses", "hits")}
    assert any(s.write_back_rows for s in stats if s.iteration < last - 1), "no eviction"
    per = job.spec.train.batch_size // trainers
    batches = [keys for keys, _, _ in build_workload(job).key_batches()]
    distinct = sum(len(np.unique(np.concatenate([k[j * per : (j + 1) * per].ravel() for k in batches]))) for j in range(trainers))
    assert total["fetch_rows"] + total["join_rows"] > distinct, (total, distinct)  # re-fetches
    assert 0 < total["hits"] < total["uses"], total
    if trainers > 1:
        assert total["join_rows"] > 0, total


#: The fast tier's two-trainer cases: every model, every optimizer, not every pair.
TWO_TRAINERS = [("dlrm", "adagrad"), ("deepfm", "sgd"), ("wide_deep", "adagrad"), ("dcn", "sgd")]


@pytest.mark.parametrize(("model", "optimizer"), TWO_TRAINERS)
def test_every_mode_is_bit_identical_with_two_trainers(tmp_path: Path, model: str, optimizer: str) -> None:
    check_every_mode(tmp_path, trainers=2, model=model, optimizer=optimizer)


@pytest.mark.parametrize("trainers", [1, 4])
def test_every_mode_is_bit_identical_with_dlrm(tmp_path: Path, trainers: int) -> None:
    check_every_mode(tmp_path, trainers=trainers, model="dlrm", optimizer="adagrad")


def _full_matrix() -> list:
    """Every (T, model, optimizer) the fast tests above leave out. Above two trainers
    (threads on two cores here) a case takes 10 to 25 CPU-seconds, so CI runs the pairs of
    `TWO_TRAINERS` at T = 4 (with the fast tier's DLRM-Adagrad: every model, both
    optimizers, past the two-trainer sums); T = 8 runs nightly, where CI holds its parts
    apart: the rank-ordered sums at T = 8 (tests/trainer/test_collectives.py) and a bagpipe
    cluster of eight against its in-process twin and the reference (test_cluster.py)."""
    cases = []
    for trainers in (1, 2, 4, 8):
        for model in MODELS:
            for optimizer in OPTIMIZERS:
                fast = (model, optimizer) in TWO_TRAINERS if trainers == 2 else model == "dlrm" and optimizer == "adagrad"
                if fast and trainers < 8:
                    continue
                in_ci = trainers < 4 or (trainers == 4 and (model, optimizer) in TWO_TRAINERS)
                cases.append(pytest.param(trainers, model, optimizer, marks=[] if in_ci else [pytest.mark.nightly]))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("trainers", "model", "optimizer"), _full_matrix())
def test_full_matrix_is_bit_identical(tmp_path: Path, trainers: int, model: str, optimizer: str) -> None:
    check_every_mode(tmp_path, trainers=trainers, model=model, optimizer=optimizer)


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("trainers", [16, 32])
def test_every_mode_is_bit_identical_with_many_trainers(tmp_path: Path, trainers: int) -> None:
    """Past the cluster sizes CI runs: 16 and 32 trainers (threads), two samples each."""
    runs = {}
    for mode in MODES:
        overrides = {
            "oracle": {"mode": mode, "cache_rows": 12},
            "trainers": {"count": trainers},
            "train": {"batch_size": 2 * trainers, "max_iterations": 30},
        }
        job = build_job(load_spec(write_spec(tmp_path, f"{mode}-t{trainers}", overrides)))
        runs[mode] = run_in_process(job)
        if mode == "bagpipe":
            bagpipe = job
    for mode in MODES[1:]:
        assert_identical(runs[mode].model, runs["bagpipe"].model)
    assert_identical(runs["bagpipe"].model, as_final(reference_for(bagpipe)))
    assert_cache_was_exercised(bagpipe, runs["bagpipe"])
