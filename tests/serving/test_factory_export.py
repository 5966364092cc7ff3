"""A `[model] factory` model exports with its module, so that `predict` rebuilds it wherever
it runs: here from a folder on the training process's path only, scored by a `predict`
process that does not have it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from launcher.inprocess import run_in_process
from serving.export import export_model
from serving.manifest import ExportManifest
from serving.predict import load_export, open_data, score
from serving.sources import open_checkpoint
from common.job import build_job
from common.spec import load_spec
from tests.cluster_helpers import write_spec
from tests.serving.conftest import CHECKPOINT, OVERRIDES, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_a_factory_model_is_exported_with_its_module_and_predicted_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = tmp_path / "own"
    (code / "mymodels").mkdir(parents=True)
    shutil.copyfile(ROOT / "examples" / "my_model.py", code / "mymodels" / "attention.py")
    monkeypatch.syspath_prepend(str(code))  # the trainers' path, not predict's
    model = {"factory": "mymodels.attention:build", "embedding_dim": 8, "deep_mlp": [16]}
    job = build_job(load_spec(write_spec(tmp_path, "factory", OVERRIDES, model=model)))
    save_checkpoint(job, run_in_process(job).model, CHECKPOINT)
    out = tmp_path / "export"
    export_model(open_checkpoint(job, CHECKPOINT), out, chunk_rows=256)
    manifest = ExportManifest.read(out)
    assert manifest.factory_code == "code/mymodels/attention.py"
    assert (out / manifest.factory_code).read_bytes() == (code / "mymodels" / "attention.py").read_bytes()
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "predict", str(out), "--json",
                           str(tmp_path / "scored.json")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = orjson.loads((tmp_path / "scored.json").read_bytes())
    exported = load_export(out)
    held_out = open_data(manifest, None, None).eval_batches(manifest.batch_size)
    want = score(exported, held_out, manifest.trainers)
    assert (got["auc"], got["log_loss"], got["count"]) == (want.auc, want.log_loss, want.count) and want.count > 0
