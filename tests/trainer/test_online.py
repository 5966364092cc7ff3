"""Online training's exactness in one process: a plan cut into segments wherever a live
stream could have run dry (oracle/live.py), trained by the real engines on real stores,
ends bit-identical to the uncut plan and to the data-parallel reference, in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.inprocess import run_in_process
from oracle.startup import build_workload
from tests.cluster_helpers import as_final, assert_identical, reference_for
from tests.trainer.test_equivalence import MODES, job_for

#: Cuts at the start, runs of consecutive cuts (one-batch segments), and a long segment.
CUTS = (1, 2, 3, 7, 13, 14, 22)


@pytest.mark.parametrize("mode", MODES)
def test_online_segments_train_bit_identical_to_offline(tmp_path: Path, mode: str) -> None:
    job = job_for(tmp_path, mode=mode, trainers=2, model="dlrm", optimizer="adagrad")
    assert build_workload(job).num_iterations > max(CUTS) + 2
    cut = run_in_process(job, segment_ends=CUTS)
    assert_identical(cut.model, as_final(reference_for(job)))
    if mode == "bagpipe":
        assert_identical(cut.model, run_in_process(job).model)
