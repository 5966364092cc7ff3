"""Predict: an export predicts what the trained model predicts, scores data in the trainers'
order, reads other files with the run's settings, and refuses what it cannot score.
(That it reproduces a real run's own held-out evaluation exactly is `test_end_to_end.py`.)"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from common.data.__main__ import main as data_tool
from common.data.dataset import open_dataset
from common.errors import ConfigError, NotFound
from serving.export import export_model
from serving.manifest import MODEL_FILE, ExportManifest
from serving.predict import every_batch, load_export, main, open_data, score
from serving.safetensors import FormatError, SafetensorsFile, StreamedTensor, dtype_code, write_safetensors
from serving.sources import open_final_run
from tests.serving.conftest import Layout
from common.steps import held_out_share
from trainer.evaluation import evaluate
from trainer.models import build_model


@pytest.fixture
def exported(tmp_path: Path, local_run: Layout) -> Path:
    out = tmp_path / "export"
    export_model(open_final_run(local_run.job, local_run.run_dir), out, chunk_rows=100)
    return out


def test_an_export_predicts_what_the_trained_model_predicts(exported: Path, local_run: Layout) -> None:
    job, trained = local_run.job, local_run.model
    model = build_model(job.model, job.num_dense, job.layout.num_tables)
    model.load_state_dict(trained.dense)
    model.eval()
    loaded = load_export(exported)
    batches = list(open_dataset(job.data).eval_batches(job.spec.train.batch_size))
    assert len(batches) > 2
    for batch in batches:
        emb = torch.from_numpy(trained.table[job.layout.to_keys(batch.sparse)])
        with torch.no_grad():
            want = torch.sigmoid(model(torch.from_numpy(batch.dense.copy()), emb)).numpy()
        assert np.array_equal(loaded.probabilities(batch), want)


def test_predictions_are_scored_in_the_order_the_trainers_gather_them(exported: Path, local_run: Layout) -> None:
    assert list(itertools.chain(*(held_out_share(range(5), rank, 2) for rank in range(2)))) == [0, 2, 4, 1, 3]
    loaded = load_export(exported)
    batches = list(open_dataset(local_run.job.data).eval_batches(32))
    gathered = [batches[i] for i in (0, 2, 4, 6, 1, 3, 5)]
    assert len(batches) == 7
    want = evaluate(np.concatenate([b.labels for b in gathered]),
                    np.concatenate([loaded.probabilities(b) for b in gathered]))
    assert score(loaded, batches, trainers=2) == want


def test_predict_scores_every_row_of_another_file(exported: Path, local_run: Layout, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The run's synthetic data written out as a preprocessed folder: every row scored."""
    folder = tmp_path / "rows"
    assert data_tool(["synth", "--spec", str(local_run.job.spec.source), "--out", str(folder)]) == 0
    argv = [str(exported), "--data", str(folder), "--format", "preprocessed", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    got = orjson.loads((tmp_path / "r.json").read_bytes())
    want = score(load_export(exported), every_batch(open_dataset(local_run.job.data), 32))
    assert want.count == local_run.job.data.rows
    assert (got["auc"], got["log_loss"], got["count"]) == (want.auc, want.log_loss, want.count)
    assert got["rows"] == "all"
    assert f"scored {want.count} rows of {folder}" in capsys.readouterr().out


def test_a_folder_that_is_not_a_complete_export_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="is not a complete export: model.json is missing"):
        load_export(tmp_path)
    (tmp_path / "model.json").write_bytes(b'{"format": "something else"}')
    with pytest.raises(FormatError, match="not a bagpipe-export manifest of version 1"):
        load_export(tmp_path)


def test_an_export_missing_a_tensor_is_refused(exported: Path) -> None:
    weights = SafetensorsFile(exported / MODEL_FILE)
    kept = [StreamedTensor(name=n, dtype=dtype_code(weights.array(n).dtype), shape=weights.shape(n),
                           chunks=lambda n=n: [weights.array(n)])
            for n in weights.names if n != "dense.top.net.0.bias"]
    write_safetensors(exported / MODEL_FILE, kept, {})
    with pytest.raises(NotFound, match="holds no tensor 'dense.top.net.0.bias'"):
        load_export(exported)


def test_data_that_does_not_fit_the_model_is_refused(exported: Path, tmp_path: Path) -> None:
    manifest = ExportManifest.read(exported)
    with pytest.raises(ConfigError, match="--format: applies to --data only"):
        open_data(manifest, None, "criteo")
    with pytest.raises(ConfigError, match="--format: .* needs a file format"):
        open_data(manifest, tmp_path, None)  # the run's data is synthetic: no format to read a file with
    other = tmp_path / "other"
    assert data_tool(["synth", "--table-sizes", "10,10,10,10", "--num-dense", "4", "--rows", "50",
                      "--out", str(other)]) == 0
    with pytest.raises(ConfigError, match=r"\(50, 200, 1000, 5000\) does not match \(10, 10, 10, 10\)"):
        open_data(manifest, other, "preprocessed")
    dictionary = dataclasses.replace(manifest, data=dataclasses.replace(manifest.data, hashing="dictionary"))
    with pytest.raises(ConfigError, match="this export holds none"):
        open_data(dictionary, other, "preprocessed")
