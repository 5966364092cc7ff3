"""What an export folder holds, and ``model.json``, the small file that describes it.

An export folder holds ``model.safetensors`` (every embedding table as ``embeddings.t<i>``,
``[rows_i, d]`` float32, and every dense parameter as ``dense.<state_dict key>``), optionally
``torchrec_dlrm.safetensors`` (the same DLRM under `torchrec.models.dlrm.DLRM`'s names, see
`serving.torchrec`), and ``model.json``, written last: a folder with it is complete.
A `[model] factory` model's module is copied under ``code/`` at its import path, so that
`predict` rebuilds the model wherever it runs. ``model.json`` records what serving needs
(the model spec, dense features, table sizes) and
what re-scoring the run's held-out rows exactly needs (the data spec, the global batch and
the trainer count its evaluation used, and the result it recorded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from common.data.spec import DataSpec
from common.model_spec import ModelSpec
from common.optimizer_spec import OptimizerSpec
from serving.safetensors import FormatError
from serving.sources import Origin, RunEval

MODEL_FILE = "model.safetensors"
TORCHREC_FILE = "torchrec_dlrm.safetensors"
MANIFEST_FILE = "model.json"
CODE_FOLDER = "code"
VOCABULARY_FOLDER = "vocab"
FORMAT = "bagpipe-export"
VERSION = 1


def table_name(table: int) -> str:
    return f"t{table}"


def embedding_key(table: int) -> str:
    """The name of table `table` in ``model.safetensors``."""
    return f"embeddings.{table_name(table)}"


def dense_key(state_key: str) -> str:
    """The name of the dense parameter `state_key` (a state_dict key) in ``model.safetensors``."""
    return f"dense.{state_key}"


@dataclass(frozen=True, kw_only=True)
class ExportManifest:
    model: ModelSpec
    num_dense: int
    table_sizes: tuple[int, ...]
    optimizer: OptimizerSpec  # how it was trained; serving does not need it
    data: DataSpec  # what it was trained on: `predict` scores its held-out rows by default
    seed: int
    batch_size: int  # the global batch: the held-out evaluation scored batches of this size,
    trainers: int  # split over this many trainers (the order its log loss was summed in)
    origin: Origin
    held_out: RunEval | None
    torchrec: bool  # whether TORCHREC_FILE was written
    #: A `[model] factory` model's module, copied under CODE_FOLDER at its import path (e.g.
    #: "code/mypkg/model.py"), which `predict` imports it from; None for a built-in model.
    factory_code: str | None = None
    #: A dictionary-encoded run's vocabularies (``vocab_<t>.npy`` as the conversion wrote them)
    #: in this folder of the export, so that `predict --data` maps new raw rows as the run
    #: did; None for hashed data.
    vocabulary: str | None = None

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        return orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def read(cls, directory: Path) -> ExportManifest:
        """The manifest of the export in `directory`; FormatError if it is not one."""
        path = directory / MANIFEST_FILE
        try:
            body = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise FormatError(f"{directory} is not a complete export: {MANIFEST_FILE} is missing "
                              "(export writes it last)") from None
        except orjson.JSONDecodeError as exc:
            raise FormatError(f"{path}: not JSON: {exc}") from None
        if not isinstance(body, dict) or (body.get("format"), body.get("version")) != (FORMAT, VERSION):
            raise FormatError(f"{path}: not a {FORMAT} manifest of version {VERSION}")
        return _from_json(path, body)


def _from_json(path: Path, body: dict[str, Any]) -> ExportManifest:
    try:
        held_out = body["held_out"]
        return ExportManifest(
            model=ModelSpec(**_tuples(body["model"])), num_dense=body["num_dense"],
            table_sizes=tuple(body["table_sizes"]), optimizer=OptimizerSpec(**body["optimizer"]),
            data=DataSpec(**_tuples(body["data"])), seed=body["seed"], batch_size=body["batch_size"],
            trainers=body["trainers"], origin=Origin(**body["origin"]),
            held_out=None if held_out is None else RunEval.from_json(held_out), torchrec=body["torchrec"],
            factory_code=body.get("factory_code"), vocabulary=body.get("vocabulary"),  # newer fields: may be absent
        )  # fmt: skip
    except (KeyError, TypeError) as exc:
        raise FormatError(f"{path}: a field is missing or malformed: {exc}") from None


def _tuples(section: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back into the tuples the specs hold."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in section.items()}
