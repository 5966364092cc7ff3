"""The TorchRec state_dict: TorchRec's own DLRM loads it, strictly, and predicts exactly what
ours predicts; a model TorchRec's DLRM cannot express is refused before anything is written.
torchrec is optional (bench/requirements-torchrec.txt): the tests that load it skip without it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from common.data.dataset import open_dataset
from common.errors import ConfigError
from common.model_spec import ModelSpec
from serving.export import export_model
from serving.manifest import TORCHREC_FILE, ExportManifest
from serving.predict import load_export
from serving.sources import open_checkpoint
from serving.torchrec_dlrm import keyed_features, load_torchrec_dlrm, torchrec_dlrm_names
from tests.serving.conftest import Layout


@pytest.fixture(scope="module")
def torchrec() -> ModuleType:
    return pytest.importorskip(
        "torchrec", reason="torchrec is optional: pip install --no-deps -r bench/requirements-torchrec.txt"
    )


@pytest.fixture
def exported(tmp_path: Path, checkpointed: Layout) -> Path:
    export_model(open_checkpoint(checkpointed.job, None), tmp_path / "export", chunk_rows=100, torchrec=True)
    return tmp_path / "export"


def test_torchrecs_dlrm_loads_the_state_dict_strictly(torchrec: ModuleType, exported: Path) -> None:
    from safetensors.torch import load_file
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    manifest = ExportManifest.read(exported)
    tables = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{t}"])
              for t, n in enumerate(manifest.table_sizes)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=4,
                 dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    state = load_file(exported / TORCHREC_FILE)  # the safetensors library's own reader
    assert sorted(state) == sorted(model.state_dict()) == sorted(torchrec_dlrm_names(manifest).values())
    model.load_state_dict(state, strict=True)


def test_torchrec_predicts_exactly_what_we_predict(
    torchrec: ModuleType, exported: Path, checkpointed: Layout
) -> None:
    ours = load_export(exported)
    theirs = load_torchrec_dlrm(exported)
    theirs.eval()
    batches = list(open_dataset(checkpointed.job.data).eval_batches(32))
    for batch in batches:
        with torch.no_grad():
            logits = theirs(torch.from_numpy(batch.dense.copy()), keyed_features(batch.sparse))  # (B, 1)
        assert np.array_equal(torch.sigmoid(logits).squeeze(-1).numpy(), ours.probabilities(batch))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "deepfm"}, "only a DLRM maps onto torchrec.models.dlrm.DLRM, not deepfm"),
        ({"top_mlp": ()}, "needs a hidden top layer"),
    ],
    ids=["deepfm", "no-hidden-top-layer"],
)
def test_a_model_torchrec_cannot_express_is_refused_before_anything_is_written(
    tmp_path: Path, checkpointed: Layout, change: dict[str, object], message: str
) -> None:
    trained = open_checkpoint(checkpointed.job, None)
    model = dataclasses.replace(trained.job.model, **change)
    unfit = dataclasses.replace(trained, job=dataclasses.replace(trained.job, model=model))
    with pytest.raises(ConfigError, match=message):
        export_model(unfit, tmp_path / "out", chunk_rows=100, torchrec=True)
    assert not (tmp_path / "out").exists()


def test_a_dlrm_without_dense_features_has_no_torchrec_counterpart(exported: Path) -> None:
    manifest = ExportManifest.read(exported)
    model = ModelSpec(name="dlrm", embedding_dim=8, bottom_mlp=(8,))
    no_dense = dataclasses.replace(manifest, num_dense=0, model=model)
    with pytest.raises(ConfigError, match="needs dense features"):
        torchrec_dlrm_names(no_dense)
