"""A run resumed with another number of PS shards, or of trainers (docs/design.md,
"Resuming every role"): every row moves to the shard that now owns it, streamed from the
snapshots of the shards that took the checkpoint, and the plan starts again from the
checkpoint's iteration with the new trainers.

The number of shards does not enter the arithmetic: the model ends bit-identical to the run
that never stopped. The number of trainers does (each slices the global batch): the model
ends bit-identical to the data-parallel reference that slices by the old count up to the
checkpoint and by the new one after it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.checkpoints import latest_complete
from common.errors import ConfigError, Conflict, NotFound
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import run_in_process
from ps.checkpoint import resharded, save_snapshot, snapshot_shards
from ps.startup import build_service, restore_own_latest
from ps.store import Snapshot
from tests.cluster_helpers import (
    as_final,
    assert_identical,
    differing_elements,
    final_model,
    reference_for,
    run_spec,
    write_spec,
)

FIRST, TOTAL, EVERY = 20, 40, 5  # the first run stops after iteration 19, a checkpoint


def _runs(tmp_path: Path, before: dict, after: dict) -> tuple:
    """A run of FIRST iterations, then one resumed from its last checkpoint to TOTAL, with
    the `after` sections instead of `before`; (job resumed, its run folder)."""
    checkpoint = {"every": EVERY, "dir": str(tmp_path / "checkpoints")}
    first = write_spec(tmp_path, "first", {**before, "train": {"max_iterations": FIRST}, "checkpoint": checkpoint})
    job, _ = run_spec(first, tmp_path / "first")
    assert latest_complete(job.spec.checkpoint.dir, job.spec.ps.num_shards) == FIRST - 1
    resumed = write_spec(tmp_path, "resumed", {**after, "train": {"max_iterations": TOTAL}, "checkpoint": checkpoint})
    job, result = run_spec(resumed, tmp_path / "resumed", resume=True)
    return job, result.run_dir


@pytest.mark.slow
# 2 -> 3 shards is nightly: in CI the bagpipe case below resumes 2 -> 3 shards (and 2 -> 4 trainers).
@pytest.mark.parametrize("shards", [1, pytest.param(3, marks=pytest.mark.nightly)])
def test_reshard_on_resume_ends_as_the_run_that_never_stopped(tmp_path: Path, shards: int) -> None:
    job, run_dir = _runs(tmp_path, {"ps": {"shards": 2}}, {"ps": {"shards": shards}})
    assert job.spec.ps.num_shards == shards
    (tmp_path / "whole").mkdir()
    whole = build_job(load_spec(write_spec(tmp_path / "whole", "whole", {"train": {"max_iterations": TOTAL}})))
    assert_identical(final_model(job, run_dir), run_in_process(whole).model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bagpipe", pytest.param("no-cache", marks=pytest.mark.nightly),
                                  pytest.param("static-cache", marks=pytest.mark.nightly)])
def test_a_resume_with_more_trainers_and_shards_slices_by_the_new_count_after_the_checkpoint(
    tmp_path: Path, mode: str
) -> None:
    oracle = {"mode": mode, "cache_rows": 100}
    job, run_dir = _runs(tmp_path, {"ps": {"shards": 2}, "trainers": {"count": 2}, "oracle": oracle},
                         {"ps": {"shards": 3}, "trainers": {"count": 4}, "oracle": oracle})
    got = final_model(job, run_dir)
    assert_identical(got, as_final(reference_for(job, slices=lambda x: 2 if x < FIRST else 4)))
    assert differing_elements(got, as_final(reference_for(job, slices=2)))  # the count did change the steps


def test_a_trainer_count_that_does_not_divide_the_batch_names_both_fields(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "odd", {"trainers": {"count": 3}, "train": {"batch_size": 32}})
    with pytest.raises(ConfigError, match="train.batch_size.*trainers.count = 3"):
        run_in_process(build_job(load_spec(spec)))


def _snapshot(keys: np.ndarray, num_shards: int, shard: int) -> Snapshot:
    mine = keys[keys % num_shards == shard]
    return Snapshot(local=mine // num_shards, rows=np.stack([mine, -mine], axis=1).astype(np.float32),
                    state=(mine[:, None] % 7).astype(np.float32), versions=mine % 11)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_resharded_streams_each_row_to_its_new_shard_in_bounded_chunks(tmp_path: Path, old: int, new: int) -> None:
    keys = np.unique(np.random.default_rng(old * 10 + new).integers(0, 10_000, 3_000))
    for s in range(old):
        save_snapshot(tmp_path / f"ps-{s}", 9, _snapshot(keys, old, s), {"shard": s, "num_shards": old})
    assert snapshot_shards(tmp_path, 9) == old
    for s in range(new):
        parts = list(resharded(tmp_path, 9, s, new, chunk_rows=100))
        assert max(len(p.local) for p in parts) <= 100
        got = Snapshot(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in ("local", "rows", "state", "versions")})
        order = np.argsort(got.local)
        want = _snapshot(keys, new, s)
        for field in ("local", "rows", "state", "versions"):
            assert np.array_equal(getattr(got, field)[order], getattr(want, field)), field


def test_a_missing_old_snapshot_is_named(tmp_path: Path) -> None:
    keys = np.arange(100)
    save_snapshot(tmp_path / "ps-0", 4, _snapshot(keys, 2, 0), {"shard": 0, "num_shards": 2})
    with pytest.raises(NotFound, match="taken by 2 shards.*ps-1 has none"):
        list(resharded(tmp_path, 4, 0, 3))


def test_a_shard_restarted_alone_never_loads_a_snapshot_of_another_layout(tmp_path: Path) -> None:
    """After a resume with 3 shards, shard 0's own latest snapshot may still be one taken by
    2: coming back alone it would serve another shard's rows. It refuses, naming --resume."""
    job = build_job(load_spec(write_spec(tmp_path, "three", {"ps": {"shards": 3}})))
    root = job.spec.checkpoint.dir
    save_snapshot(root / "ps-0", 4, _snapshot(np.arange(50), 2, 0), {"shard": 0, "num_shards": 2})
    with pytest.raises(Conflict, match="taken by 2 PS shards and this run has 3.*--resume"):
        restore_own_latest(build_service(job, 0))
