"""The model a finished run or a complete checkpoint left on disk, opened without loading a
table whole.

A finished run (`common.checkpoints.final_paths`) holds rank 0's dense state_dict and
``final.json`` (``{"iterations": N, "ps_checkpoint": N or null}``, written last); its tables
are the PS shards' snapshot N in the spec's checkpoint directory, or in local mode one
``[total_rows, d]`` array beside the dense state. Checkpoint c (`common.checkpoints`) is the
shards' snapshot c, trainer 0's dense state and optimizer, and the manifest that says it is
complete.

A shard's snapshot holds only the rows written during training (``local`` indices, sorted
ascending, with their ``rows``); every other row still has its initial value, a pure function
of (seed, key) (`common.init`). A table is rebuilt a chunk of keys at a time: the chunk's
initial rows, overwritten by each shard's rows that fall in it. Every file is read with
plain reads into fresh arrays: memory holds one chunk, never a table, and no memmap's pages
pile up in the process's resident set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import orjson
import torch

from common.checkpoints import dense_path, final_paths, latest_complete, manifest_path, missing_parts, ps_dir
from common.errors import ConfigError, NotFound
from common.init import initial_rows
from common.job import Job
from common.keys import shard_size
from ps.checkpoint import snapshot_files
from serving.safetensors import FormatError
from trainer.models import build_model
from trainer.records import EvalRecord, read_records, trainer_log_path


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where exported parameters come from: a finished run's folder, or a checkpoint's manifest."""

    kind: Literal["final", "checkpoint"]
    path: str
    iterations: int  # training iterations the parameters have seen


@dataclass(frozen=True, kw_only=True)
class RunEval:
    """The held-out evaluation a finished run recorded (trainer 0's records)."""

    iteration: int
    auc: float
    log_loss: float
    count: int

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RunEval:
        """From its own JSON (an export's manifest), where an undefined AUC (one class only)
        is null: JSON has no NaN."""
        auc = math.nan if record["auc"] is None else float(record["auc"])
        return cls(iteration=int(record["iteration"]), auc=auc, log_loss=float(record["log_loss"]),
                   count=int(record["count"]))

    @classmethod
    def of(cls, record: EvalRecord) -> RunEval:
        """The evaluation a trainer recorded."""
        return cls(iteration=record.iteration, auc=record.auc, log_loss=record.log_loss, count=record.count)


StateDict = dict[str, torch.Tensor]


class TableSource(Protocol):
    def chunks(self, table: int, chunk_rows: int) -> Iterator[np.ndarray]:
        """Table `table`'s rows in order, as float32 ``[<= chunk_rows, d]`` arrays."""
        ...


@dataclass(frozen=True, kw_only=True)
class TrainedModel:
    job: Job  # the spec the run was trained with
    dense: StateDict  # the model's, checked against the spec's model
    tables: TableSource
    origin: Origin
    held_out: RunEval | None  # None for a checkpoint, or a run that recorded none


def open_final_run(job: Job, run_dir: Path) -> TrainedModel:
    """The model a finished run left in `run_dir`; NotFound naming the first missing file."""
    paths = final_paths(run_dir)
    if not paths.info.is_file():
        raise NotFound(f"{run_dir} holds no finished run: {paths.info} is missing (a run writes it "
                       "last, once its model is saved)", missing=[str(paths.info)])
    info = orjson.loads(paths.info.read_bytes())
    dense = dense_state(job, paths.dense, lambda saved: saved)
    if info["ps_checkpoint"] is None:  # local mode: the trainer saved the whole table
        tables: TableSource = FullTable(job, NpyFile.open(paths.table))
    else:
        tables = ShardSnapshots.open(job, int(info["ps_checkpoint"]))
    origin = Origin(kind="final", path=str(run_dir.resolve()), iterations=int(info["iterations"]))
    return TrainedModel(job=job, dense=dense, tables=tables, origin=origin, held_out=_held_out(run_dir))


def open_checkpoint(job: Job, checkpoint: int | None) -> TrainedModel:
    """Checkpoint `checkpoint` (None: the latest complete one) in the spec's checkpoint
    directory; NotFound naming every missing part of an incomplete one."""
    directory, shards = job.spec.checkpoint.dir, job.spec.ps.num_shards
    if checkpoint is None:
        checkpoint = latest_complete(directory, shards)
        if checkpoint is None:
            raise NotFound(f"no complete checkpoint in {directory}")
    missing = missing_parts(directory, checkpoint, shards)
    if len(missing) == shards + 2:  # the manifest, the dense state and every snapshot: none at all
        raise NotFound(f"there is no checkpoint {checkpoint} in {directory} (the latest complete one: "
                       f"{latest_complete(directory, shards)})", missing=[str(p) for p in missing])
    if missing:
        raise NotFound(f"checkpoint {checkpoint} in {directory} is incomplete: missing "
                       f"{', '.join(map(str, missing))}", missing=[str(p) for p in missing])
    dense = dense_state(job, dense_path(directory, checkpoint), lambda saved: saved["model"])
    tables = ShardSnapshots.open(job, checkpoint)
    manifest = str(manifest_path(directory, checkpoint))
    origin = Origin(kind="checkpoint", path=manifest, iterations=checkpoint + 1)
    return TrainedModel(job=job, dense=dense, tables=tables, origin=origin, held_out=None)


def dense_state(job: Job, path: Path, state_of: Callable[[Any], StateDict]) -> StateDict:
    """The state_dict in `path` (`state_of` picks it out of what was saved), checked against
    the spec's model: a spec edited since the run fails here, naming what differs."""
    if not path.is_file():
        raise NotFound(f"{path} is missing", missing=[str(path)])
    state = state_of(torch.load(path, map_location="cpu", weights_only=True))
    model = build_model(job.model, job.num_dense, job.layout.num_tables)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError("model", f"the dense parameters in {path} do not fit the spec's model "
                          f"(was the spec changed after the run?): {exc}") from None
    return dict(state)


def _held_out(run_dir: Path) -> RunEval | None:
    """The last held-out evaluation in trainer 0's records, if it wrote any."""
    path = trainer_log_path(run_dir, 0)
    records = read_records(path) if path.exists() else []
    evals = [r for r in records if isinstance(r, EvalRecord) and r.split == "held-out"]
    return RunEval.of(evals[-1]) if evals else None


@dataclass(frozen=True, kw_only=True)
class NpyFile:
    """A C-order .npy file whose row ranges are read into fresh arrays on demand."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # where the data starts

    @classmethod
    def open(cls, path: Path) -> NpyFile:
        """Read the header; NotFound if absent, FormatError if not a whole C-order array."""
        headers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        try:
            with open(path, "rb") as fh:
                version = np.lib.format.read_magic(fh)
                if version not in headers:
                    raise FormatError(f"{path}: .npy version {version} is not supported")
                shape, fortran, dtype = headers[version](fh)
                offset = fh.tell()
        except FileNotFoundError:
            raise NotFound(f"{path} is missing", missing=[str(path)]) from None
        except ValueError as exc:
            raise FormatError(f"{path}: not a .npy file: {exc}") from None
        npy = cls(path=path, dtype=dtype, shape=shape, offset=offset)
        if fortran or dtype.hasobject or path.stat().st_size < offset + npy.nbytes:
            raise FormatError(f"{path}: not a whole C-order array of {shape} {dtype}")
        return npy

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes if self.shape else self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)``."""
        out = np.empty((stop - start, *self.shape[1:]), self.dtype)
        with open(self.path, "rb") as fh:
            fh.seek(self.offset + start * self.row_bytes)
            got = fh.readinto(out.reshape(-1).view(np.uint8))
        if got != out.nbytes:
            raise FormatError(f"{self.path}: rows {start}..{stop} are cut short")
        return out

    def expect(self, dtype: type, shape: tuple[int, ...]) -> NpyFile:
        """Itself if it holds `shape` of `dtype`, else FormatError."""
        if self.dtype != np.dtype(dtype) or self.shape != shape:
            raise FormatError(f"{self.path} holds {self.shape} {self.dtype}, expected {shape} "
                              f"{np.dtype(dtype)}")
        return self


class FullTable:
    """Every table in one ``[total_rows, d]`` array (a local-mode run's final table)."""

    def __init__(self, job: Job, table: NpyFile) -> None:
        self.offsets = job.layout.offsets
        self.table = table.expect(np.float32, (job.layout.total_rows, job.dim))

    def chunks(self, table: int, chunk_rows: int) -> Iterator[np.ndarray]:
        first, end = int(self.offsets[table]), int(self.offsets[table + 1])
        for start, stop in _ranges(first, end, chunk_rows):
            yield self.table.read(start, stop)


@dataclass(frozen=True, kw_only=True)
class _Shard:
    """One shard's snapshot: the rows it wrote, by ascending local index (key // num_shards)."""

    index: int
    num_shards: int
    local: NpyFile  # int64 [n], ascending
    rows: NpyFile  # float32 [n, d]

    def position_of(self, key: int) -> int:
        """Where this shard's first row with a key >= `key` is: a binary search of a few reads."""
        target, lo, hi = self.first_local(key), 0, self.local.shape[0]
        while lo < hi:
            mid = (lo + hi) // 2
            if self.local.read(mid, mid + 1)[0] < target:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def overlay(self, out: np.ndarray, position: int, start: int, stop: int) -> int:
        """Write into `out` (the rows of keys [start, stop)) this shard's rows in that range,
        which begin at `position`; returns the position after them."""
        most = -(-(stop - start) // self.num_shards)  # the shard owns at most this many keys of the range
        block = self.local.read(position, min(position + most, self.local.shape[0]))
        local = block[: int(np.searchsorted(block, self.first_local(stop)))]
        if len(local) and (local[0] < self.first_local(start) or np.any(np.diff(local) <= 0)):
            raise FormatError(f"{self.local.path}: local indices are not strictly ascending")
        out[local * self.num_shards + self.index - start] = self.rows.read(position, position + len(local))
        return position + len(local)

    def first_local(self, key: int) -> int:
        """The smallest local index of this shard whose key is >= `key`."""
        return -(-(key - self.index) // self.num_shards)


class ShardSnapshots:
    """The tables as the shards' snapshots of one checkpoint hold them (module docstring)."""

    def __init__(self, job: Job, shards: list[_Shard]) -> None:
        self.job = job
        self.shards = shards

    @classmethod
    def open(cls, job: Job, checkpoint: int) -> ShardSnapshots:
        """NotFound if a shard's snapshot is missing; FormatError if one does not fit the spec."""
        num_shards = job.spec.ps.num_shards
        return cls(job, [open_shard(job, s, num_shards, checkpoint) for s in range(num_shards)])

    def chunks(self, table: int, chunk_rows: int) -> Iterator[np.ndarray]:
        layout, seed, dim = self.job.layout, self.job.spec.seed, self.job.dim
        first, end = int(layout.offsets[table]), int(layout.offsets[table + 1])
        # Each shard's next unread position: chunks go up in key order, so do the shards' rows.
        positions = [shard.position_of(first) for shard in self.shards]
        for start, stop in _ranges(first, end, chunk_rows):
            rows = initial_rows(layout, seed, np.arange(start, stop, dtype=np.int64), dim)
            positions = [shard.overlay(rows, position, start, stop)
                         for shard, position in zip(self.shards, positions, strict=True)]
            yield rows


def open_shard(job: Job, shard: int, num_shards: int, checkpoint: int) -> _Shard:
    files = snapshot_files(ps_dir(job.spec.checkpoint.dir, shard), checkpoint)
    if not files["meta"].is_file():
        raise NotFound(f"PS shard {shard} has no snapshot {checkpoint}: {files['meta']} is missing",
                       missing=[str(files["meta"])])
    meta = orjson.loads(files["meta"].read_bytes())
    if (meta.get("shard"), meta.get("num_shards")) != (shard, num_shards):
        raise ConfigError("ps.shards", f"{files['meta']} is shard {meta.get('shard')} of "
                          f"{meta.get('num_shards')}, the spec expects shard {shard} of {num_shards}")
    local = NpyFile.open(files["local"])
    n = local.expect(np.int64, (local.shape[0],)).shape[0]
    rows = NpyFile.open(files["rows"]).expect(np.float32, (n, job.dim))
    limit = shard_size(job.layout.total_rows, shard, num_shards)
    if n and not 0 <= local.read(n - 1, n)[0] < limit:
        raise FormatError(f"{files['local']}: indices go past this shard's {limit} rows: does the spec's "
                          "[data] match the run's?")
    return _Shard(index=shard, num_shards=num_shards, local=local, rows=rows)


def _ranges(start: int, stop: int, step: int) -> Iterator[tuple[int, int]]:
    for first in range(start, stop, step):
        yield first, min(first + step, stop)
