"""The central guarantee at the length where rounding would show: on the shipped Criteo
sample (two epochs, 250 iterations of 64 samples, 26 tables), every mode ends bit-identical
to every other mode for T = 1, 2 and 4, and to the data-parallel reference for T <= 2.

Each bagpipe run's cache is a fraction of one iteration's worst case (72 %), so it
evicts, joins and re-fetches all along (asserted). With T = 4 the reference differs only
through DDP's dense all-reduce, which adds the four trainers' gradients in its ring's order:
one step from the same state leaves every embedding row and state bit-identical, and each
dense gradient within the rounding bound of a reordered sum (tested below). Training then
amplifies those last bits (dense Adagrad divides by accumulators that start near zero).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.data.samples import CRITEO_KAGGLE as KAGGLE
from common.job import Job, build_job
from common.spec import load_spec
from launcher.inprocess import FinalModel, run_in_process
from oracle.main import build_workload
from tests.cluster_helpers import as_final, assert_identical, differing_elements, reference_for, write_spec
from tests.trainer.reference import ReferenceTrainer
from tests.trainer.test_equivalence import MODES, assert_cache_was_exercised

BATCH = 64
FEATURES = 26


def criteo_job(tmp_path: Path, *, mode: str, trainers: int, iterations: int = 0) -> Job:
    assert KAGGLE.is_file(), f"sample missing: {KAGGLE}"
    per_iteration = BATCH // trainers * FEATURES  # the most rows one trainer can use at once
    cache = per_iteration + 256 if mode == "static-cache" else int(per_iteration * 0.72)
    overrides = {
        "oracle": {"mode": mode, "cache_rows": cache, "lookahead": 10, "prefetch_lead": 3},
        "trainers": {"count": trainers},
        "train": {"batch_size": BATCH, "epochs": 2, "max_iterations": iterations},
        "model": {"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
    }
    data = {"format": "criteo", "path": str(KAGGLE.resolve()), "table_sizes": [500] * FEATURES}
    return build_job(load_spec(write_spec(tmp_path, f"criteo-{mode}-t{trainers}", overrides, data=data)))


@pytest.mark.parametrize("trainers", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=[pytest.mark.slow, pytest.mark.nightly])])
def test_every_mode_is_bit_identical_over_two_criteo_epochs(tmp_path: Path, trainers: int) -> None:
    runs = {}
    for mode in MODES:
        job = criteo_job(tmp_path, mode=mode, trainers=trainers)
        runs[mode] = run_in_process(job)
        assert len(runs[mode].stats[0]) == 250
    for mode in MODES[1:]:
        assert_identical(runs[mode].model, runs["bagpipe"].model)
    bagpipe = criteo_job(tmp_path, mode="bagpipe", trainers=trainers)
    assert_cache_was_exercised(bagpipe, runs["bagpipe"])
    if trainers <= 2:
        assert_identical(runs["bagpipe"].model, as_final(reference_for(bagpipe)))


def test_with_four_trainers_one_step_differs_from_the_reference_only_in_dense_summation_order(tmp_path: Path) -> None:
    """One step from the initial state: embedding rows and state bit-identical; each dense
    gradient element within the classic bound of a reordered float32 sum of T terms,
    (T - 1) * 2**-24 * sum_r |g_r / T| (the largest relative rounding of each addition)."""
    trainers = 4
    job = criteo_job(tmp_path, mode="bagpipe", trainers=trainers, iterations=1)
    run = run_in_process(job)
    differing = differing_elements(run.model, as_final(reference_for(job)))
    assert "embedding rows" not in differing and "optimizer state" not in differing, differing
    keys, labels, dense = next(build_workload(job).key_batches())
    reference = ReferenceTrainer(job.model, job.optimizer, job.layout, job.spec.seed, job.num_dense)
    per = BATCH // trainers
    names = [name for name, _ in reference.model.named_parameters()]
    magnitude = [torch.zeros_like(p) for p in reference.model.parameters()]
    in_rank_order = [torch.zeros_like(p) for p in reference.model.parameters()]
    for r in range(trainers):
        part = slice(r * per, (r + 1) * per)
        _, grads, _, _ = reference.slice_gradients(
            torch.from_numpy(labels[part].copy()), torch.from_numpy(dense[part].copy()), torch.from_numpy(keys[part])
        )
        for m, total, g in zip(magnitude, in_rank_order, grads):
            m.add_((g / trainers).abs())
            total.add_(g * (1.0 / trainers))
    reordered = 0
    for name, m, total in zip(names, magnitude, in_rank_order):
        error = (run.dense_grads[name] - total).abs()
        assert bool((error <= (trainers - 1) * 2.0**-24 * m).all()), name
        reordered += int((error > 0).sum())
    assert reordered, "expected DDP's ring order to round some dense gradient differently"


def test_final_model_helper_sees_a_one_bit_change() -> None:
    """The bit-identity checks above can fail: one flipped bit anywhere is reported."""
    dense = {"w": np.ones((2, 2), np.float32)}
    a = FinalModel({k: torch.from_numpy(v) for k, v in dense.items()}, np.ones((3, 2), np.float32), np.zeros((3, 1), np.float32))
    table = a.table.copy()
    table.view(np.uint32)[1, 1] ^= 1
    b = FinalModel(a.dense, table, a.state)
    assert differing_elements(a, b) == {"embedding rows": 1}
    with pytest.raises(AssertionError, match="not bit-identical"):
        assert_identical(a, b)
