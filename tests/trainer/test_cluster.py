"""Real clusters (oracle, PS shards and trainer processes over HTTP/2 and gloo) end bit for
bit where the in-process harness and the data-parallel reference end: one run per mode,
and runs with three, four and eight trainers, where the sums' rank order matters. The full matrix
of modes, models, optimizers and trainer counts runs in process (test_equivalence.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.job import Job, build_job
from launcher.inprocess import run_in_process
from launcher.zygote import COLD_START_ENV
from tests.cluster_helpers import (
    as_final,
    assert_identical,
    final_model,
    reference_for,
    run_spec,
    write_spec,
)
from tests.trainer.test_equivalence import CACHE_ROWS, MODES
from trainer.device import select_device
from trainer.records import CheckpointRecord, IterationRecord, Record, ThreadsRecord, read_run
from trainer.startup import seeded_model

pytestmark = pytest.mark.slow


# The modes whose real clusters CI runs: local (no PS) and bagpipe (every kind of directive).
# no-cache and static-cache run the same processes and code with other directives; in CI their
# bits are checked in process (tests/trainer/test_equivalence.py, every mode against the
# reference), and nightly here.
CI_MODES = ("local", "bagpipe")


@pytest.mark.parametrize("mode", [m if m in CI_MODES else pytest.param(m, marks=pytest.mark.nightly) for m in MODES])
def test_a_cluster_is_bit_identical_to_the_reference(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "local":  # its roles start as fresh interpreters; every other cluster forks them warm
        monkeypatch.setenv(COLD_START_ENV, "1")
    overrides = {"oracle": {"mode": mode, "cache_rows": CACHE_ROWS[2]}, "trainers": {"count": 2}}
    job, result = run_spec(write_spec(tmp_path, mode, overrides), tmp_path / "run")
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(job)))
    started = sorted(p.stem for p in (result.run_dir / "logs").glob("*.log"))
    # local mode's trainers hold the whole table and write it to final/ themselves: no PS
    shards = [] if mode == "local" else ["ps-0", "ps-1"]
    assert started == ["oracle", *shards, "trainer-0", "trainer-1"]
    assert_bytes_by_kind_add_up(job, read_run(result.run_dir, 2), mode)


def test_trainers_whose_ps_clients_run_in_helper_processes_end_bit_identical(tmp_path: Path) -> None:
    """`[trainers] ps_client = "process"`: every fetch and write-back through the helper's
    shared memory, checkpoints reported through its control channel; the same bits, and the
    helper's CPU recorded apart from the trainer's threads."""
    overrides = {"oracle": {"mode": "bagpipe", "cache_rows": CACHE_ROWS[2]},
                 "trainers": {"count": 2, "ps_client": "process"}, "checkpoint": {"every": 20}}
    job, result = run_spec(write_spec(tmp_path, "helper", overrides), tmp_path / "run")
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(job)))
    records = read_run(result.run_dir, 2)
    for j in range(2):
        samples = [r for r in records[j] if isinstance(r, ThreadsRecord)]
        assert samples and samples[-1].cpu.get("process ps-client", 0.0) > 0, samples[-1:]
        assert any(isinstance(r, CheckpointRecord) for r in records[0])


def assert_bytes_by_kind_add_up(job: Job, records: dict[int, list[Record]], mode: str) -> None:
    dense = 4 * sum(p.numel() for p in seeded_model(job, select_device("cpu", 0)).parameters())
    iterations = [r for recs in records.values() for r in recs if isinstance(r, IterationRecord)]
    for r in iterations:
        assert r.sync_bytes == r.sync_now_bytes + r.sync_later_bytes + r.join_bytes
        assert r.dense_bytes == dense
    assert sum(r.sync_now_bytes for r in iterations) > 0 and sum(r.sync_later_bytes for r in iterations) > 0
    # only bagpipe copies rows between trainers
    assert (sum(r.join_bytes for r in iterations) > 0) == (mode == "bagpipe")


@pytest.mark.parametrize(
    ("trainers", "shards", "batch", "cache"),
    [pytest.param(3, 2, 48, 70, marks=pytest.mark.nightly), (4, 2, 32, CACHE_ROWS[4]), (8, 4, 32, CACHE_ROWS[8])],
)
def test_clusters_past_two_trainers_are_bit_identical_to_the_harness_and_the_reference(
    tmp_path: Path, trainers: int, shards: int, batch: int, cache: int
) -> None:
    """Where the rank order of the sums matters (T > 2): embedding and dense gradients."""
    overrides = {
        "oracle": {"mode": "bagpipe", "cache_rows": cache},
        "trainers": {"count": trainers},
        "ps": {"shards": shards},
        "train": {"batch_size": batch, "max_iterations": 40},
    }
    job, result = run_spec(write_spec(tmp_path, f"bagpipe-t{trainers}", overrides), tmp_path / "run")
    got = final_model(job, result.run_dir)
    assert_identical(got, run_in_process(job).model)
    assert_identical(got, as_final(reference_for(job)))


def test_checkpoints_every_few_iterations_over_several_epochs_change_nothing(tmp_path: Path) -> None:
    """Checkpoints every 3 iterations over 4 epochs with a tight cache: shared rows often leave
    a trainer at a checkpoint while another keeps them (175 flushes written by a leaving copy
    in this plan), the order a failed checkpoint came from (the keeper's newer write reached
    the PS first and the flush, sent as a plain write-back, was refused). Every checkpoint
    completes and the model ends as the same run without checkpoints does."""
    overrides = {
        "oracle": {"mode": "bagpipe", "cache_rows": 64},
        "train": {"epochs": 4, "max_iterations": 0},
        "checkpoint": {"every": 3},
    }
    job, result = run_spec(write_spec(tmp_path, "checkpointed", overrides), tmp_path / "run")
    unchecked = dataclasses.replace(job.spec, checkpoint=dataclasses.replace(job.spec.checkpoint, every=0))
    assert_identical(final_model(job, result.run_dir), run_in_process(build_job(unchecked)).model)
    records = read_run(result.run_dir, 2)[0]  # rank 0 records each checkpoint once complete
    iterations = sum(isinstance(r, IterationRecord) for r in records)
    complete = [r.iteration for r in records if isinstance(r, CheckpointRecord)]
    assert iterations > 200 and sorted(complete) == list(range(2, iterations, 3))
