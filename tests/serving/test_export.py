"""Export: a checkpoint or a finished run becomes safetensors holding exactly its tables and
dense parameters, read in bounded chunks; incomplete or mismatched inputs are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from safetensors.numpy import load_file

from common.checkpoints import dense_path, final_paths, manifest_path, ps_dir
from common.errors import ConfigError, NotFound
from common.init import initial_rows
from common.job import Job
from launcher.inprocess import FinalModel
from ps.checkpoint import snapshot_files
from serving.export import export_model
from serving.manifest import MANIFEST_FILE, MODEL_FILE, ExportManifest
from serving.safetensors import FormatError
from serving.sources import TrainedModel, open_checkpoint, open_final_run
from tests.serving.conftest import (
    CHECKPOINT,
    OVERRIDES,
    Layout,
    job_in,
    save_checkpoint,
    save_local_final,
    table_slices,
)
from trainer.models import build_model

ROOT = Path(__file__).resolve().parents[2]


def opened(layout: Layout, kind: str) -> TrainedModel:
    if kind == "checkpoint":
        return open_checkpoint(layout.job, None)
    return open_final_run(layout.job, layout.run_dir)


def assert_holds(path: Path, job: Job, model: FinalModel) -> None:
    """The file at `path` holds every table and dense parameter of `model`, bit for bit."""
    loaded = load_file(path)
    tables = table_slices(job, model.table)
    expected = {f"embeddings.t{t}": table for t, table in enumerate(tables)}
    expected |= {f"dense.{key}": value.numpy() for key, value in model.dense.items()}
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == np.float32 and np.array_equal(loaded[name], array), name


@pytest.fixture(params=["checkpoint", "local_run"])
def either(request: pytest.FixtureRequest) -> tuple[Layout, str]:
    """A checkpoint, or a local-mode run's final model, and which."""
    name = "checkpointed" if request.param == "checkpoint" else request.param
    return request.getfixturevalue(name), request.param


def test_an_export_holds_every_table_and_dense_parameter(tmp_path: Path, either: tuple[Layout, str]) -> None:
    layout, kind = either
    # 37 rows a chunk: smaller than every table but the first, and dividing none of them.
    result = export_model(opened(layout, kind), tmp_path / "out", chunk_rows=37)
    assert_holds(tmp_path / "out" / MODEL_FILE, layout.job, layout.model)
    manifest = ExportManifest.read(tmp_path / "out")
    assert manifest == result.manifest
    assert manifest.origin.iterations == CHECKPOINT + 1
    assert manifest.table_sizes == layout.job.layout.sizes and manifest.model == layout.job.model
    assert sorted(os.listdir(tmp_path / "out")) == [MANIFEST_FILE, MODEL_FILE]


def test_a_snapshot_holds_only_written_rows_and_the_rest_start_initial(checkpointed: Layout) -> None:
    """The layout under test: without the initial values the tables would be mostly wrong."""
    job = checkpointed.job
    local = np.load(snapshot_files(ps_dir(job.spec.checkpoint.dir, 0), CHECKPOINT)["local"])
    assert 0 < len(local) < job.layout.total_rows // 4


# One table of 65,536 rows of 16 floats: 4 MiB, read 256 rows (16 KiB) at a time.
BIG_ROWS, BIG_DIM, BIG_CHUNK = 65_536, 16, 256
BIG = {
    **OVERRIDES,
    "data": {"format": "synthetic", "rows": 100, "table_sizes": [BIG_ROWS], "num_dense": 4, "seed": 1},
    "model": {"name": "dlrm", "embedding_dim": BIG_DIM, "bottom_mlp": [BIG_DIM], "top_mlp": [8]},
}


def big_model(job: Job) -> FinalModel:
    """Random rows written to a tenth of the table, the rest initial."""
    rng = np.random.default_rng(0)
    table = initial_rows(job.layout, job.spec.seed, np.arange(BIG_ROWS), BIG_DIM)
    written = rng.choice(BIG_ROWS, BIG_ROWS // 10, replace=False)
    table[written] = rng.standard_normal((len(written), BIG_DIM), dtype=np.float32)
    dense = build_model(job.model, job.num_dense, 1).state_dict()
    return FinalModel(dense=dense, table=table, state=np.zeros((BIG_ROWS, 1), np.float32))


@pytest.mark.parametrize("kind", ["checkpoint", "local_run"])
def test_a_table_is_streamed_in_chunks_with_bounded_memory(tmp_path: Path, kind: str) -> None:
    job = job_in(tmp_path, BIG)
    model = big_model(job)
    save_checkpoint(job, model, CHECKPOINT)
    save_local_final(tmp_path / "run", model, iterations=CHECKPOINT + 1)
    trained = opened(Layout(job=job, model=model, run_dir=tmp_path / "run"), kind)
    sizes = [len(chunk) for chunk in trained.tables.chunks(0, BIG_CHUNK)]
    assert sizes == [BIG_CHUNK] * (BIG_ROWS // BIG_CHUNK)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        export_model(trained, tmp_path / "out", chunk_rows=BIG_CHUNK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < model.table.nbytes / 8, f"peak {peak:,} bytes for a table of {model.table.nbytes:,}"
    assert_holds(tmp_path / "out" / MODEL_FILE, job, model)


@pytest.mark.parametrize("part", ["manifest", "dense", "snapshot of shard 1"])
def test_an_incomplete_checkpoint_is_refused_naming_what_is_missing(checkpointed: Layout, part: str) -> None:
    directory = checkpointed.job.spec.checkpoint.dir
    missing = {
        "manifest": manifest_path(directory, CHECKPOINT),
        "dense": dense_path(directory, CHECKPOINT),
        "snapshot of shard 1": snapshot_files(ps_dir(directory, 1), CHECKPOINT)["meta"],
    }[part]
    missing.unlink()
    with pytest.raises(NotFound, match=f"checkpoint {CHECKPOINT} in .* is incomplete: missing {missing}$") as err:
        open_checkpoint(checkpointed.job, CHECKPOINT)
    assert err.value.fields["missing"] == [str(missing)]
    with pytest.raises(NotFound, match="no complete checkpoint in"):
        open_checkpoint(checkpointed.job, None)


def test_a_checkpoint_that_never_was_is_named_so(checkpointed: Layout) -> None:
    with pytest.raises(NotFound, match=f"there is no checkpoint 5 in .* latest complete one: {CHECKPOINT}"):
        open_checkpoint(checkpointed.job, 5)


def test_a_run_that_did_not_finish_is_refused(local_run: Layout) -> None:
    paths = final_paths(local_run.run_dir)
    paths.table.unlink()
    with pytest.raises(NotFound, match=f"{paths.table} is missing"):
        open_final_run(local_run.job, local_run.run_dir)
    paths.info.unlink()
    with pytest.raises(NotFound, match=r"holds no finished run: .*final\.json is missing"):
        open_final_run(local_run.job, local_run.run_dir)


def test_the_final_tables_of_a_ps_run_must_be_on_disk(checkpointed: Layout) -> None:
    """A run with PS shards names their final snapshot (here, the checkpoint's) in final.json."""
    paths = final_paths(checkpointed.run_dir)
    paths.dense.parent.mkdir(parents=True)
    torch.save(checkpointed.model.dense, paths.dense)
    paths.info.write_bytes(orjson.dumps({"iterations": CHECKPOINT + 1, "ps_checkpoint": CHECKPOINT}))
    assert open_final_run(checkpointed.job, checkpointed.run_dir).origin.kind == "final"
    meta = snapshot_files(ps_dir(checkpointed.job.spec.checkpoint.dir, 0), CHECKPOINT)["meta"]
    meta.unlink()
    with pytest.raises(NotFound, match=f"PS shard 0 has no snapshot {CHECKPOINT}: {meta} is missing"):
        open_final_run(checkpointed.job, checkpointed.run_dir)


def test_a_spec_changed_since_the_run_is_refused(checkpointed: Layout) -> None:
    spec_dir = checkpointed.job.spec.checkpoint.dir.parent  # the same checkpoints, another spec
    wider = job_in(spec_dir, {**OVERRIDES, "model": {"bottom_mlp": [32, 8]}})
    with pytest.raises(ConfigError, match="do not fit the spec's model"):
        open_checkpoint(wider, CHECKPOINT)
    smaller = job_in(spec_dir, {**OVERRIDES, "data": {"table_sizes": [50, 200, 1000, 500]}})
    with pytest.raises(FormatError, match="indices go past this shard's"):
        open_checkpoint(smaller, CHECKPOINT)


def test_a_corrupt_snapshot_fails_the_export_and_leaves_no_torn_file(
    tmp_path: Path, checkpointed: Layout
) -> None:
    out = tmp_path / "out"
    export_model(open_checkpoint(checkpointed.job, CHECKPOINT), out, chunk_rows=37)
    before = (out / MODEL_FILE).read_bytes()
    local_file = snapshot_files(ps_dir(checkpointed.job.spec.checkpoint.dir, 1), CHECKPOINT)["local"]
    local = np.load(local_file)
    local[len(local) // 2 :] = local[len(local) // 2 :][::-1]  # no longer ascending past the middle
    np.save(local_file, local)
    with pytest.raises(FormatError, match="not strictly ascending"):
        export_model(open_checkpoint(checkpointed.job, CHECKPOINT), out, chunk_rows=37)
    assert os.listdir(out) == [MODEL_FILE], "no manifest: the folder no longer reads as a complete export"
    assert (out / MODEL_FILE).read_bytes() == before
    with pytest.raises(FormatError, match="not a complete export"):
        ExportManifest.read(out)


def test_a_truncated_table_is_refused(local_run: Layout) -> None:
    table = final_paths(local_run.run_dir).table
    os.truncate(table, table.stat().st_size - 4)
    with pytest.raises(FormatError, match="not a whole C-order array"):
        open_final_run(local_run.job, local_run.run_dir)


@pytest.mark.slow  # a fresh interpreter importing torch: seconds on a loaded machine
def test_launch_py_export_reports_a_bad_argument_and_exits_2(checkpointed: Layout, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "launch.py"), "export", str(checkpointed.job.spec.source),
               "--checkpoint", "oldest", "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip() == "launch.py: --checkpoint: must be a checkpoint number or 'latest', got 'oldest'"
