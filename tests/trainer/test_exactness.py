"""The central guarantee at the length where rounding would show: on the shipped Criteo
sample (two epochs, 250 iterations of 64 samples, 26 tables), every mode ends bit-identical
to every other mode and to the data-parallel reference, for T = 1, 2 and 4.

Each bagpipe run's cache is a fraction of one iteration's worst case (72 %), so it
evicts, joins and re-fetches all along (asserted). Above two trainers this rests on the
rank-ordered sums (tests/trainer/test_collectives.py shows a ring all-reduce would not do):
training amplifies a last bit anywhere (dense Adagrad divides by accumulators that start
near zero).
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
from tests.cluster_helpers import as_final, assert_identical, differing_elements, reference_for, write_spec
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
    assert_identical(runs["bagpipe"].model, as_final(reference_for(bagpipe)))


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
