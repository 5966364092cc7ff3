"""``python launch.py predict EXPORT_DIR``: score data with an exported model; prints AUC and
log loss. EXPORT_DIR may be a running job's chain of exports (``[export]``; `serving.chain`):
it is read as the full export of its last link.

By default it scores the held-out rows of the data the run trained on the way the run's own
evaluation did (`trainer.final`): the same rows in batches of the run's global batch, the
predictions concatenated in the order the trainers gathered them, scored by the same
`trainer.evaluation.evaluate`. On the CPU it reproduces the run's held-out AUC and log loss
bit for bit. ``--data FILE`` scores every row of another file instead, read with the run's
data settings (its format unless ``--format`` says otherwise, and its hashing into the
model's table sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
from torch import nn

from common.data.dataset import Batch, Dataset, open_dataset
from common.data.synthetic import Rows
from common.data.spec import RAW_FORMATS
from common.errors import ConfigError
from common.files import write_atomically
from serving.chain import CHAIN_FILE, ExportChain, deltas, index_key, rows_key
from serving.manifest import CODE_FOLDER, MODEL_FILE, ExportManifest, dense_key, embedding_key
from serving.safetensors import FormatError, SafetensorsFile
from common.steps import held_out_share
from trainer.evaluation import EvalResult, MetricAccumulator
from trainer.models import build_model


@dataclass(frozen=True, kw_only=True)
class ExportedModel:
    manifest: ExportManifest
    model: nn.Module  # in eval mode
    tables: tuple[np.ndarray, ...]  # [rows_t, d], mapped read-only: a lookup reads its rows' pages

    def probabilities(self, batch: Batch) -> np.ndarray:
        """Click probabilities (float32) of the batch's samples."""
        emb = np.stack([table[batch.sparse[:, t]] for t, table in enumerate(self.tables)], axis=1)  # (B,F,d)
        dense = torch.from_numpy(np.array(batch.dense))  # a copy: batches may be read-only views
        with torch.no_grad():
            return torch.sigmoid(self.model(dense, torch.from_numpy(emb))).numpy()


def load_export(directory: Path) -> ExportedModel:
    """The model exported into `directory`, or the last link of the chain there (a running
    job's exports: `serving.chain`); FormatError if the folder is not a complete export."""
    if (directory / CHAIN_FILE).is_file():
        return load_chain(directory)
    manifest = ExportManifest.read(directory)
    weights = SafetensorsFile(directory / MODEL_FILE)
    if manifest.factory_code is not None:  # the factory's own module, as exported, comes first
        code = str((directory / CODE_FOLDER).resolve())
        if code not in sys.path:
            sys.path.insert(0, code)
    model = build_model(manifest.model, manifest.num_dense, len(manifest.table_sizes))
    state = {key: torch.from_numpy(np.array(weights.array(dense_key(key)))) for key in model.state_dict()}
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise FormatError(f"{weights.path}: the dense parameters do not fit the manifest: {exc}") from None
    model.eval()
    tables = tuple(weights.array(embedding_key(t)) for t in range(len(manifest.table_sizes)))
    for t, (table, rows) in enumerate(zip(tables, manifest.table_sizes, strict=True)):
        if table.shape != (rows, manifest.model.embedding_dim):
            raise FormatError(f"{weights.path}: table {t} has shape {table.shape}, the manifest says "
                              f"({rows}, {manifest.model.embedding_dim})")
    return ExportedModel(manifest=manifest, model=model, tables=tables)


def load_chain(directory: Path) -> ExportedModel:
    """The chain in `directory` (`serving.chain`) at its last link: its base, each delta's
    rows written over it in order, the last delta's dense parameters."""
    chain = ExportChain.read(directory)
    if not chain.links:
        raise FormatError(f"{directory / CHAIN_FILE} holds no export yet")
    base = load_export(directory / chain.links[0].folder)
    tables = [np.array(t) for t in base.tables]  # copies: the deltas are written over them
    model = base.model
    for link, delta in deltas(chain):
        for t, table in enumerate(tables):
            index, rows = delta.array(index_key(t)), delta.array(rows_key(t))
            if index.size and (index[0] < 0 or index[-1] >= table.shape[0] or rows.shape != (index.size, table.shape[1])):
                raise FormatError(f"{delta.path}: table {t}'s rows do not fit its {table.shape} table")
            table[index] = rows
        state = {key: torch.from_numpy(np.array(delta.array(dense_key(key)))) for key in model.state_dict()}
        model.load_state_dict(state)
    manifest = dataclasses.replace(base.manifest, origin=dataclasses.replace(
        base.manifest.origin, iterations=chain.links[-1].checkpoint + 1))
    for table in tables:
        table.flags.writeable = False
    return ExportedModel(manifest=manifest, model=model, tables=tuple(tables))


def score(exported: ExportedModel, batches: Iterable[Batch], trainers: int = 1) -> EvalResult:
    """AUC and log loss over `batches`, the predictions concatenated as `trainers` trainers'
    held-out evaluation gathers them (`held_out_share`): log loss is a sum, and a sum's last
    bits depend on its order."""
    scored = [(batch.labels, exported.probabilities(batch)) for batch in batches]
    acc = MetricAccumulator()
    for rank in range(trainers):
        for labels, probs in held_out_share(scored, rank, trainers):
            acc.add(labels, probs)
    return acc.result()


def open_data(manifest: ExportManifest, path: Path | None, fmt: str | None, vocabulary: Path | None = None) -> Dataset:
    """The run's data (`path` None), or the file `path` read with the run's data settings;
    ConfigError if it does not fit the model's tables. A dictionary-encoded run's file is
    mapped through the vocabularies exported in the folder `vocabulary`."""
    spec = manifest.data
    if path is None and fmt is not None:
        raise ConfigError("--format", "applies to --data only")
    if path is not None:
        if spec.hashing == "dictionary":
            return _through_vocabulary(manifest, path, fmt, vocabulary)
        fmt = fmt or spec.format
        if fmt not in (*RAW_FORMATS, "preprocessed"):
            raise ConfigError("--format", f"{path} needs a file format ({', '.join(RAW_FORMATS)} or "
                              "preprocessed)")
        # Its own conversion cache, beside it: a cache_dir holds one source per data settings.
        spec = dataclasses.replace(spec, format=fmt, path=str(path.resolve()), cache_dir=None)
    dataset = open_dataset(spec, progress=path is not None)
    if tuple(dataset.table_sizes) != manifest.table_sizes or dataset.num_dense != manifest.num_dense:
        raise ConfigError("--data", f"{spec.path} has tables of {list(dataset.table_sizes)} rows and "
                          f"{dataset.num_dense} dense features; the model has {list(manifest.table_sizes)} "
                          f"and {manifest.num_dense}")
    return dataset


class _InMemory(Dataset):
    """Rows already read (a file mapped through a run's dictionary)."""

    def __init__(self, rows: Rows, table_sizes: tuple[int, ...]) -> None:
        super().__init__(num_rows=len(rows.labels), num_dense=rows.dense.shape[1], table_sizes=table_sizes,
                         eval_fraction=0.0)
        self._rows = rows

    def rows(self, start: int, stop: int) -> Rows:
        r = self._rows
        return Rows(labels=r.labels[start:stop], dense=r.dense[start:stop], sparse=r.sparse[start:stop])


def _through_vocabulary(manifest: ExportManifest, path: Path, fmt: str | None, vocabulary: Path | None) -> Dataset:
    """Every row of the raw file `path`, its values mapped to rows by the run's exported
    dictionary: a value the run never saw (or saw too rarely) takes the rare row, as in
    training. Read whole into memory."""
    from common.data.mapping import RowMapper
    from common.data.raw import RawReader

    spec = manifest.data
    if vocabulary is None or manifest.vocabulary is None:
        raise ConfigError("--data", "the run mapped categorical values through a dictionary, and this export "
                          "holds none (exported before dictionaries were): export the run again")
    if (fmt or spec.format) != spec.format:
        raise ConfigError("--format", f"a dictionary maps {spec.format} values: {fmt} rows cannot be scored")
    spec = dataclasses.replace(spec, path=str(path.resolve()), cache_dir=None, on_error="fail")
    mapper = RowMapper.load_dictionary(vocabulary, len(manifest.table_sizes), spec.table_sizes)
    if mapper.sizes != manifest.table_sizes:
        raise FormatError(f"{vocabulary}: its dictionaries make tables of {list(mapper.sizes)} rows, the model "
                          f"has {list(manifest.table_sizes)}")
    chunks = list(RawReader(spec).chunks())
    if not chunks:
        raise ConfigError("--data", f"{path} holds no rows")
    return _InMemory(Rows(labels=np.concatenate([c.labels for c in chunks]),
                          dense=np.concatenate([c.dense for c in chunks]),
                          sparse=np.concatenate([mapper.rows(c.ids) for c in chunks])), manifest.table_sizes)


def every_batch(dataset: Dataset, batch_size: int) -> Iterator[Batch]:
    """Every row of `dataset` in order, the last batch possibly shorter."""
    for i, first in enumerate(range(0, dataset.num_rows, batch_size)):
        rows = dataset.rows(first, min(first + batch_size, dataset.num_rows))
        yield Batch(index=i, labels=rows.labels, dense=rows.dense, sparse=rows.sparse)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launch.py predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a folder written by `launch.py export`")
    parser.add_argument("--data", type=Path,
                        help="score every row of this file or folder instead of the run's held-out rows")
    parser.add_argument("--format", help="the format of --data (default: the run's)")
    parser.add_argument("--json", type=Path, help="also write the result to this file as JSON")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    exported = load_export(args.export)
    manifest = exported.manifest
    folder = args.export  # a chain's dictionaries are its base's
    if (folder / CHAIN_FILE).is_file():
        folder = folder / ExportChain.read(folder).links[0].folder
    vocabulary = folder / manifest.vocabulary if manifest.vocabulary else None
    dataset = open_data(manifest, args.data, args.format, vocabulary)
    if args.data is None:
        batches = dataset.eval_batches(manifest.batch_size)
        result = score(exported, batches, manifest.trainers)
        what = f"{result.count} held-out rows of {manifest.data.path or 'synthetic data'}"
    else:
        result = score(exported, every_batch(dataset, manifest.batch_size))
        what = f"{result.count} rows of {args.data}"
    print(format_result(what, result, manifest if args.data is None else None))
    if args.json is not None:
        data = str(args.data) if args.data else manifest.data.path  # None: synthetic
        body = {"data": data, "rows": "all" if args.data else "held-out", **dataclasses.asdict(result)}
        write_atomically(args.json, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


def format_result(what: str, result: EvalResult, run: ExportManifest | None) -> str:
    """The scores at full precision; with `run`, beside the run's own held-out evaluation."""
    lines = [f"scored {what}", f"  AUC       {result.auc!r}", f"  log loss  {result.log_loss!r}"]
    recorded = run.held_out if run is not None else None
    if recorded is not None:
        same = _same(recorded.auc, result.auc) and recorded.log_loss == result.log_loss
        lines.append(f"  the run's own held-out evaluation (iteration {recorded.iteration}): "
                     f"AUC {recorded.auc!r}, log loss {recorded.log_loss!r}: {'identical' if same else 'differs'}")
    return "\n".join(lines)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
