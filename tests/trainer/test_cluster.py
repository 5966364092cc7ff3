"""Real clusters (oracle, PS shards and trainer processes over HTTP/2 and gloo) end bit for
bit where the in-process harness and the data-parallel reference end: one run per mode,
and one with four trainers, where the embedding sums' rank order matters. The full matrix
of modes, models, optimizers and trainer counts runs in process (test_equivalence.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.inprocess import run_in_process
from tests.cluster_helpers import as_final, assert_identical, final_model, reference_for, run_spec, write_spec
from tests.trainer.test_equivalence import CACHE_ROWS, MODES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", MODES)
def test_a_cluster_is_bit_identical_to_the_reference(tmp_path: Path, mode: str) -> None:
    overrides = {"oracle": {"mode": mode, "cache_rows": CACHE_ROWS[2]}, "trainers": {"count": 2}}
    job, result = run_spec(write_spec(tmp_path, mode, overrides), tmp_path / "run")
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(job)))
    started = sorted(p.stem for p in (result.run_dir / "logs").glob("*.log"))
    # local mode's trainers hold the whole table and write it to final/ themselves: no PS
    shards = [] if mode == "local" else ["ps-0", "ps-1"]
    assert started == ["oracle", *shards, "trainer-0", "trainer-1"]


def test_a_four_trainer_cluster_is_bit_identical_to_the_harness(tmp_path: Path) -> None:
    overrides = {"oracle": {"mode": "bagpipe", "cache_rows": CACHE_ROWS[4]}, "trainers": {"count": 4}}
    job, result = run_spec(write_spec(tmp_path, "bagpipe-t4", overrides), tmp_path / "run")
    assert_identical(final_model(job, result.run_dir), run_in_process(job).model)
