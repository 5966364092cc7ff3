"""``python launch.py export SPEC.toml --out DIR``: a finished run's model, or a complete
checkpoint's, as safetensors for serving (`serving.manifest` lists what DIR holds).

Tables are streamed: each is copied in chunks of ``--chunk-mb`` from wherever the run left it
(`serving.sources`), so memory holds a chunk and never a whole table, and each file is
written to a temporary name and renamed, so a failed export leaves no torn file.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError, NotFound
from common.files import write_atomically
from common.job import Job, build_job
from common.spec import load_spec
from serving.manifest import (
    CODE_FOLDER,
    MANIFEST_FILE,
    VOCABULARY_FOLDER,
    MODEL_FILE,
    TORCHREC_FILE,
    ExportManifest,
    dense_key,
    embedding_key,
)
from serving.safetensors import SafetensorsFile, StreamedTensor, dtype_code, write_renamed, write_safetensors
from serving.sources import TrainedModel, open_checkpoint, open_final_run
from serving.torchrec_dlrm import torchrec_dlrm_names

DEFAULT_CHUNK_MB = 4.0  # measured: export peaks about 10 chunks above its start (initial rows)
METADATA = {"format": "pt", "producer": "bagpipe"}  # "pt": torch tensors, by the format's convention


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    directory: Path
    manifest: ExportManifest
    files: dict[str, int]  # file name -> bytes, in the order written
    seconds: float


def export_model(
    trained: TrainedModel, out: Path, *, chunk_rows: int, torchrec: bool = False
) -> ExportResult:
    """Write `trained` into the folder `out` (made if needed; an earlier export there is
    replaced). With `torchrec`, also the TorchRec DLRM state_dict (ConfigError, before
    anything is written, for a model TorchRec's DLRM cannot express)."""
    if chunk_rows < 1:
        raise ConfigError("--chunk-mb", f"a chunk must hold at least one row, got {chunk_rows} rows")
    started = time.perf_counter()
    manifest = _manifest(trained, torchrec, _factory_code(trained.job))
    vocabularies = _vocabulary_files(trained.job)
    names = torchrec_dlrm_names(manifest) if torchrec else None
    out.mkdir(parents=True, exist_ok=True)
    # The folder is a complete export again only once the manifest, written last, is back.
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    tensors = model_tensors(trained, chunk_rows)
    files = {MODEL_FILE: write_safetensors(out / MODEL_FILE, tensors, METADATA)}
    if manifest.factory_code is not None:
        files[manifest.factory_code] = _copy_factory_code(trained.job, out / manifest.factory_code)
    for source in vocabularies:
        (out / VOCABULARY_FOLDER).mkdir(exist_ok=True)
        body = source.read_bytes()
        write_atomically(out / VOCABULARY_FOLDER / source.name, body)
        files[f"{VOCABULARY_FOLDER}/{source.name}"] = len(body)
    if names is None:
        (out / TORCHREC_FILE).unlink(missing_ok=True)  # an earlier export's would not match
    else:  # the same bytes under TorchRec's names: copied, not computed again
        source = SafetensorsFile(out / MODEL_FILE)
        files[TORCHREC_FILE] = write_renamed(source, out / TORCHREC_FILE, names, METADATA)
    body = manifest.to_json()
    write_atomically(out / MANIFEST_FILE, body)
    files[MANIFEST_FILE] = len(body)
    return ExportResult(directory=out, manifest=manifest, files=files, seconds=time.perf_counter() - started)


def model_tensors(trained: TrainedModel, chunk_rows: int) -> list[StreamedTensor]:
    """The dense parameters (small, whole), then every table in chunks of `chunk_rows` rows."""
    dense = [_whole(dense_key(key), value.detach().cpu().contiguous().numpy())
             for key, value in trained.dense.items()]
    dim = trained.job.dim
    tables = [
        StreamedTensor(name=embedding_key(t), dtype="F32", shape=(rows, dim),
                       chunks=_table_chunks(trained, t, chunk_rows))
        for t, rows in enumerate(trained.job.layout.sizes)
    ]  # fmt: skip
    return dense + tables


def _whole(name: str, array: np.ndarray) -> StreamedTensor:
    return StreamedTensor(name=name, dtype=dtype_code(array.dtype), shape=array.shape, chunks=lambda: (array,))


def _table_chunks(
    trained: TrainedModel, table: int, chunk_rows: int
) -> Callable[[], Iterable[np.ndarray]]:
    return lambda: trained.tables.chunks(table, chunk_rows)


def _manifest(trained: TrainedModel, torchrec: bool, factory_code: str | None) -> ExportManifest:
    job = trained.job
    return ExportManifest(
        model=job.model, num_dense=job.num_dense, table_sizes=job.layout.sizes, optimizer=job.optimizer,
        data=job.data, seed=job.spec.seed, batch_size=job.spec.train.batch_size,
        trainers=job.spec.trainers.count, origin=trained.origin,
        held_out=trained.held_out, torchrec=torchrec, factory_code=factory_code,
        vocabulary=VOCABULARY_FOLDER if job.data.hashing == "dictionary" else None,
    )  # fmt: skip


def _vocabulary_files(job: Job) -> list[Path]:
    """A dictionary-encoded run's vocabularies, where its conversion left them; NotFound if
    they are gone (the cache was deleted), before anything is written."""
    if job.data.hashing != "dictionary":
        return []
    from common.data.dataset import cache_path
    from common.data.mapping import vocabulary_file

    folder = cache_path(job.data)
    files = [folder / vocabulary_file(t) for t in range(job.layout.num_tables)]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise NotFound(f"the run's dictionary is not in its conversion cache {folder} any more: "
                       f"{', '.join(missing)}", missing=missing)
    return files


def _factory_module(job: Job) -> tuple[str, Path] | None:
    """A factory model's module: its dotted name and its source file (None for a built-in
    model); ConfigError naming `model.factory` when it is not a module file to copy."""
    if job.model.factory is None:
        return None
    module = job.model.factory.partition(":")[0]
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None or not found.origin.endswith(".py"):
        raise ConfigError("model.factory", f"{module!r} is not a Python source file export can copy for predict")
    return module, Path(found.origin)


def _factory_code(job: Job) -> str | None:
    """Where the factory's module goes in the export: under CODE_FOLDER at its import path."""
    module = _factory_module(job)
    return None if module is None else str(Path(CODE_FOLDER, *module[0].split(".")).with_suffix(".py"))


def _copy_factory_code(job: Job, to: Path) -> int:
    module = _factory_module(job)
    assert module is not None
    to.parent.mkdir(parents=True, exist_ok=True)
    body = module[1].read_bytes()
    write_atomically(to, body)
    return len(body)


def chunk_rows_of(chunk_mb: float, dim: int) -> int:
    """Rows of `dim` float32 values in a chunk of `chunk_mb` MiB (at least one)."""
    return max(1, int(chunk_mb * (1 << 20)) // (4 * dim))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launch.py export", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="the cluster spec the run was trained with")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (made if needed)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run-dir", type=Path,
                        help="the finished run to export (default runs/<name>, as launch.py)")
    source.add_argument("--checkpoint", help="export checkpoint C of the spec's checkpoint directory instead "
                        "(a number, or 'latest': the newest complete one)")
    parser.add_argument("--torchrec", action="store_true", help="also write torchrec_dlrm.safetensors: "
                        "a state_dict for torchrec.models.dlrm.DLRM")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                        help="MiB of a table copied at a time (default %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    job = build_job(load_spec(args.spec))
    if args.checkpoint is not None:
        trained = open_checkpoint(job, _checkpoint_id(args.checkpoint))
    else:
        trained = open_final_run(job, args.run_dir or Path("runs") / job.spec.name)
    chunk_rows = chunk_rows_of(args.chunk_mb, job.dim)
    result = export_model(trained, args.out, chunk_rows=chunk_rows, torchrec=args.torchrec)
    print(format_result(result))
    return 0


def _checkpoint_id(text: str) -> int | None:
    if text == "latest":
        return None
    if not text.isdigit():
        raise ConfigError("--checkpoint", f"must be a checkpoint number or 'latest', got {text!r}")
    return int(text)


def format_result(result: ExportResult) -> str:
    origin, total = result.manifest.origin, sum(result.files.values())
    what = "the finished run" if origin.kind == "final" else "checkpoint"
    lines = [f"exported {what} {origin.path} ({origin.iterations} iterations) to {result.directory} "
             f"in {result.seconds:.2f} s ({total / max(result.seconds, 1e-9) / 1e6:.1f} MB/s)"]
    lines += [f"  {name:<28}{size:>16,} bytes" for name, size in result.files.items()]
    return "\n".join(lines)
