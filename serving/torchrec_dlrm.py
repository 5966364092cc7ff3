"""Our DLRM under the names `torchrec.models.dlrm.DLRM` gives its parameters.

The two compute the same function, layer by layer (`trainer/models/dlrm.py`):

* TorchRec's ``dense_arch`` is our ``bottom``: a Linear and a ReLU per layer, the last layer
  included (``dense_arch.model._mlp.<i>._linear`` is our ``bottom.net.<2i>``).
* ``inter_arch`` is our `pairwise_dots`: the bottom output and the F pooled embeddings stacked
  into ``(B, 1 + F, d)``, every dot product of the strict upper triangle in row-major order,
  the bottom output concatenated in front. It has no parameters.
* ``over_arch`` is our ``top``: a Linear and a ReLU per hidden layer
  (``over_arch.model.0._mlp.<i>._linear`` is our ``top.net.<2i>``), then a plain Linear to
  one logit (``over_arch.model.1``).
* ``sparse_arch.embedding_bag_collection.embedding_bags.t<i>`` is table i, sum-pooled over
  the ids of feature ``f<i>``. With one id per sample and feature, as our data has, the
  pooled value is the row itself.

Where they differ: TorchRec's DLRM takes a `KeyedJaggedTensor` of ids and returns ``(B, 1)``
logits, ours takes the looked-up rows and returns ``(B,)``; it has no form without dense
features (our DLRM of Avazu-like data has no bottom MLP) nor one without a hidden top layer
(its OverArch refuses a single layer): such models have no TorchRec counterpart.

torchrec is an optional dependency (`bench/requirements-torchrec.txt`): only
`load_torchrec_dlrm` and `keyed_features` import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.errors import ConfigError
from serving.manifest import TORCHREC_FILE, ExportManifest, dense_key, embedding_key, table_name
from serving.safetensors import SafetensorsFile

if TYPE_CHECKING:
    from torchrec.models.dlrm import DLRM
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_EMBEDDING = "sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"


def feature_name(table: int) -> str:
    return f"f{table}"


def torchrec_dlrm_names(manifest: ExportManifest) -> dict[str, str]:
    """Our name of every tensor (as in ``model.safetensors``) -> TorchRec DLRM's state_dict
    key. ConfigError for a model TorchRec's DLRM cannot express."""
    spec = manifest.model
    if spec.name != "dlrm":
        raise ConfigError("--torchrec", f"only a DLRM maps onto torchrec.models.dlrm.DLRM, not {spec.name}")
    if manifest.num_dense == 0:
        raise ConfigError("--torchrec", "TorchRec's DLRM needs dense features; this DLRM has none")
    if not spec.top_mlp:
        raise ConfigError("--torchrec", "TorchRec's DLRM needs a hidden top layer (model.top_mlp is empty)")
    names = {embedding_key(t): _EMBEDDING.format(table=table_name(t)) for t in range(len(manifest.table_sizes))}
    layers = [(f"bottom.net.{2 * i}", f"dense_arch.model._mlp.{i}._linear") for i in range(len(spec.bottom_mlp))]
    layers += [(f"top.net.{2 * i}", f"over_arch.model.0._mlp.{i}._linear") for i in range(len(spec.top_mlp))]
    layers.append((f"top.net.{2 * len(spec.top_mlp)}", "over_arch.model.1"))
    for ours, theirs in layers:
        for part in ("weight", "bias"):
            names[dense_key(f"{ours}.{part}")] = f"{theirs}.{part}"
    return names


def load_torchrec_dlrm(directory: Path) -> DLRM:
    """TorchRec's DLRM (CPU) holding the parameters of the export in `directory`, which must
    have been made with ``--torchrec``, or of the last link of the chain of exports there
    (`serving.chain`: its base and deltas, renamed as ``--torchrec`` names them). Its tables
    are copied into memory."""
    from serving.chain import CHAIN_FILE

    if (directory / CHAIN_FILE).is_file():
        from serving.predict import load_chain

        exported = load_chain(directory)
        ours = {embedding_key(t): torch.from_numpy(np.array(table)) for t, table in enumerate(exported.tables)}
        ours |= {dense_key(key): value for key, value in exported.model.state_dict().items()}
        names = torchrec_dlrm_names(exported.manifest)
        return _torchrec_dlrm(exported.manifest, {names[name]: tensor for name, tensor in ours.items()})
    weights = SafetensorsFile(directory / TORCHREC_FILE)
    state = {name: torch.from_numpy(np.array(weights.array(name))) for name in weights.names}
    return _torchrec_dlrm(ExportManifest.read(directory), state)


def _torchrec_dlrm(manifest: ExportManifest, state: dict[str, torch.Tensor]) -> DLRM:
    """TorchRec's DLRM of `manifest`'s model, holding `state` (its own keys, strictly)."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    spec = manifest.model
    configs = [EmbeddingBagConfig(name=table_name(t), embedding_dim=spec.embedding_dim, num_embeddings=n,
                                  feature_names=[feature_name(t)], pooling=PoolingType.SUM)
               for t, n in enumerate(manifest.table_sizes)]
    # Tables on the meta device: they take memory only once loaded (assign=True below).
    tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=tables, dense_in_features=manifest.num_dense,
                 dense_arch_layer_sizes=list(spec.bottom_mlp), over_arch_layer_sizes=[*spec.top_mlp, 1])
    model.load_state_dict(state, strict=True, assign=True)
    return model


def keyed_features(sparse: np.ndarray) -> KeyedJaggedTensor:
    """A batch's ids ``(B, F)`` as TorchRec's input: feature ``f<t>`` holds one id per sample."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = np.ascontiguousarray(np.asarray(sparse, dtype=np.int64).T)  # (F, B): a KJT is feature-major
    return KeyedJaggedTensor(keys=[feature_name(t) for t in range(ids.shape[0])],
                             values=torch.from_numpy(ids).view(-1), lengths=torch.ones(ids.size, dtype=torch.int32))
