"""A dictionary-encoded run exports its vocabularies, so that `predict --data` maps the
values of new raw rows as training did: rows it trained on score as the run's own copy of
them, and values it never saw take the rare row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from common.data.dataset import open_dataset
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import run_in_process
from serving.export import export_model
from serving.manifest import ExportManifest
from serving.predict import every_batch, load_export, main, open_data, score
from serving.sources import open_checkpoint
from tests.cluster_helpers import write_spec
from tests.serving.conftest import CHECKPOINT, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "criteo_kaggle_head8000.tsv"


def test_new_raw_rows_are_mapped_through_the_exported_dictionary(tmp_path: Path) -> None:
    lines = SAMPLE.read_text().splitlines(keepends=True)[:1200]
    (tmp_path / "train.tsv").write_text("".join(lines))
    data = {"format": "criteo", "path": str(tmp_path / "train.tsv"), "hashing": "dictionary", "min_frequency": 2}
    overrides = {"trainers": {"count": 1}, "train": {"max_iterations": 12}, "oracle": {"cache_rows": 4096}}
    job = build_job(load_spec(write_spec(tmp_path, "dictionary", overrides, data=data)))
    save_checkpoint(job, run_in_process(job).model, CHECKPOINT)
    out = tmp_path / "export"
    export_model(open_checkpoint(job, CHECKPOINT), out, chunk_rows=256)
    manifest = ExportManifest.read(out)
    assert manifest.vocabulary == "vocab" and len(list((out / "vocab").iterdir())) == 26
    # rows the run trained on: mapped as its own conversion mapped them
    (tmp_path / "seen.tsv").write_text("".join(lines[:300]))
    seen = open_data(manifest, tmp_path / "seen.tsv", None, out / "vocab")
    trained = open_dataset(job.data)
    assert np.array_equal(seen.rows(0, 300).sparse, trained.rows(0, 300).sparse)
    want = score(load_export(out), every_batch(seen, manifest.batch_size))
    assert main([str(out), "--data", str(tmp_path / "seen.tsv"), "--json", str(tmp_path / "r.json")]) == 0
    got = orjson.loads((tmp_path / "r.json").read_bytes())
    assert (got["auc"], got["log_loss"], got["count"]) == (want.auc, want.log_loss, 300)
    # a value the run never saw lands on the rare row
    fields = lines[0].rstrip("\n").split("\t")
    fields[14] = "deadbeef"  # C1
    (tmp_path / "new.tsv").write_text("\t".join(fields) + "\n")
    assert open_data(manifest, tmp_path / "new.tsv", None, out / "vocab").rows(0, 1).sparse[0, 0] == 1
