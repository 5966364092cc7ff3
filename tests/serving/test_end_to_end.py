"""A real local cluster (oracle, two PS shards and two trainers as processes), then
``launch.py export`` and ``launch.py predict`` as a user runs them: the export holds the
run's final parameters bit for bit, and predict reproduces the run's own held-out AUC and log
loss exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.numpy import load_file

from common.checkpoints import dense_path
from common.job import Job
from serving.manifest import MODEL_FILE, TORCHREC_FILE, ExportManifest
from tests.cluster_helpers import final_model, run_spec, write_spec
from tests.serving.test_export import assert_holds
from trainer.records import EvalRecord, read_records, trainer_log_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS, EVERY = 20, 8  # checkpoints after iterations 7 and 15


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Path]:
    directory = tmp_path_factory.mktemp("cluster")
    overrides = {"train": {"max_iterations": ITERATIONS}, "checkpoint": {"every": EVERY}}
    spec = write_spec(directory, "e2e", overrides)
    job, result = run_spec(spec, directory / "run")
    return job, result.run_dir


def launch(*args: object) -> str:
    """``launch.py ARGS`` in a subprocess; its standard output (it must succeed)."""
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def exported(run: tuple[Job, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The run exported, 10 KiB at a time; the folder and what export printed."""
    job, run_dir = run
    out = tmp_path_factory.mktemp("export")
    printed = launch("export", job.spec.source, "--run-dir", run_dir, "--out", out, "--chunk-mb", 0.01, "--torchrec")
    return out, printed


def test_a_finished_run_exports_its_final_parameters(run: tuple[Job, Path], exported: tuple[Path, str]) -> None:
    (job, run_dir), (out, printed) = run, exported
    assert printed.startswith(f"exported the finished run {run_dir} ({ITERATIONS} iterations) to {out}")
    assert_holds(out / MODEL_FILE, job, final_model(job, run_dir))
    assert len(load_file(out / TORCHREC_FILE)) == len(load_file(out / MODEL_FILE))


def test_predict_reproduces_the_runs_held_out_evaluation_exactly(
    run: tuple[Job, Path], exported: tuple[Path, str], tmp_path: Path
) -> None:
    (job, run_dir), (out, _) = run, exported
    printed = launch("predict", out, "--json", tmp_path / "scores.json")
    got = orjson.loads((tmp_path / "scores.json").read_bytes())
    records = read_records(trainer_log_path(run_dir, 0))
    recorded = [r for r in records if isinstance(r, EvalRecord) and r.split == "held-out"][-1]
    assert (got["auc"], got["log_loss"], got["count"]) == (recorded.auc, recorded.log_loss, recorded.count)
    assert recorded.count == job.data.rows // 10  # every held-out row
    assert printed.endswith(": identical\n"), printed


def test_the_runs_latest_checkpoint_exports(run: tuple[Job, Path], tmp_path: Path) -> None:
    job, _ = run
    latest = 2 * EVERY - 1
    launch("export", job.spec.source, "--checkpoint", "latest", "--out", tmp_path)
    manifest = ExportManifest.read(tmp_path)
    origin = manifest.origin
    assert (origin.kind, origin.iterations, manifest.held_out) == ("checkpoint", latest + 1, None)
    saved = torch.load(dense_path(job.spec.checkpoint.dir, latest))["model"]
    exported = load_file(tmp_path / MODEL_FILE)
    assert all((exported[f"dense.{key}"] == value.numpy()).all() for key, value in saved.items())
    assert "AUC" in launch("predict", tmp_path)
