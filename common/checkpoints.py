"""Which iterations are checkpoints, where a cluster's checkpoint lives on disk, and which one
is the latest complete.

With ``[checkpoint] every`` = n > 0, checkpoints are taken after iterations n-1, 2n-1, ...
(`is_checkpoint`); the oracle marks them, the PS shards and trainers save them.

Checkpoint c is made of one snapshot per PS shard (``<dir>/ps-<s>/ckpt-<c>/``), the dense
model and optimizer of trainer 0 (``<dir>/trainer/dense-<c>.pt``) and, written last, the
manifest ``<dir>/ckpt-<c>.json``. Only a checkpoint whose manifest and parts all exist is
complete; recovery ignores the others (docs/design.md#checkpoints).

A finished run leaves its model in ``<run dir>/final/`` (`final_paths`), its tables as the
PS shards' snapshot N (the run's length) in the checkpoint directory, or in local mode as one
array beside the dense state.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

from common.files import write_atomically

_PREFIX = "ckpt-"
#: Matches what `checkpoint_name` makes.
CHECKPOINT_GLOB = f"{_PREFIX}*"
#: An iteration, or an int64 array of them.
Iterations = TypeVar("Iterations", int, np.ndarray)


def is_checkpoint(iteration: int, every: int) -> bool:
    """Whether a checkpoint is taken after `iteration` when one is taken every `every`
    iterations (0: never)."""
    return every > 0 and (iteration + 1) % every == 0


def first_checkpoint_from(iteration: Iterations, every: int) -> Iterations:
    """The first checkpoint iteration c >= `iteration`, elementwise for an array; `every` > 0.

    Arithmetic, not a walk: a far iteration costs no more than a near one.
    """
    return (iteration + every) // every * every - 1


def checkpoint_name(checkpoint_id: int) -> str:
    """The name of checkpoint `checkpoint_id`'s PS snapshot folders and the stem of its manifest."""
    return f"{_PREFIX}{checkpoint_id:010d}"


def parse_checkpoint_name(name: str) -> int:
    """The id in a name made by `checkpoint_name`."""
    return int(name.removeprefix(_PREFIX))


def ps_dir(directory: Path, shard: int) -> Path:
    return directory / f"ps-{shard}"


def dense_path(directory: Path, checkpoint_id: int) -> Path:
    return directory / "trainer" / f"dense-{checkpoint_id:010d}.pt"


def manifest_path(directory: Path, checkpoint_id: int) -> Path:
    return directory / f"{checkpoint_name(checkpoint_id)}.json"


def write_manifest(directory: Path, checkpoint_id: int, num_shards: int, extra: dict[str, Any]) -> Path:
    """Publish checkpoint `checkpoint_id` as complete."""
    path = manifest_path(directory, checkpoint_id)
    body = {"checkpoint": checkpoint_id, "shards": num_shards, "time": time.time(), **extra}
    write_atomically(path, orjson.dumps(body))
    return path


def is_complete(directory: Path, checkpoint_id: int, num_shards: int) -> bool:
    return not missing_parts(directory, checkpoint_id, num_shards)


def missing_parts(directory: Path, checkpoint_id: int, num_shards: int) -> list[Path]:
    """The files checkpoint `checkpoint_id` lacks to be complete (none when it is): the
    manifest and dense state, and the snapshot of every shard whose folder is here. The
    manifest is written only once every shard has saved its snapshot; a shard on another
    machine keeps its snapshots there, and checks for its own when it resumes (`ps.startup`).
    The shards are those that took it, as its manifest says (a run may resume with another
    number of shards: `ps.checkpoint.resharded`); `num_shards` where it has none."""
    manifest = manifest_path(directory, checkpoint_id)
    shards = shards_of(directory, checkpoint_id, num_shards)
    parts = [manifest, dense_path(directory, checkpoint_id)]
    parts += [ps_dir(directory, s) / checkpoint_name(checkpoint_id) / "meta.json" for s in range(shards)
              if ps_dir(directory, s).is_dir()]
    return [p for p in parts if not p.is_file()]


def shards_of(directory: Path, checkpoint_id: int, default: int) -> int:
    """How many PS shards took checkpoint `checkpoint_id`: its manifest's count, `default`
    without a readable manifest."""
    try:
        shards = orjson.loads(manifest_path(directory, checkpoint_id).read_bytes()).get("shards")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return default
    return shards if type(shards) is int and shards > 0 else default


@dataclass(frozen=True, kw_only=True)
class FinalPaths:
    """The files of a finished run's model: rank 0's dense state_dict, in local mode the whole
    table and its optimizer state, and `info` (``{"iterations", "ps_checkpoint"}``), written
    last."""

    dense: Path
    table: Path
    state: Path
    info: Path


def final_paths(run_dir: Path) -> FinalPaths:
    final = run_dir / "final"
    return FinalPaths(dense=final / "dense.pt", table=final / "table.npy", state=final / "state.npy",
                      info=final / "final.json")


def latest_complete(directory: Path, num_shards: int) -> int | None:
    """The newest complete checkpoint's iteration, or None."""
    return next(iter(complete_checkpoints(directory, num_shards)), None)


def prune(directory: Path, num_shards: int, keep: int, *, protect: Collection[int] = ()) -> list[int]:
    """Delete every checkpoint, complete or not, older than the `keep` newest complete ones
    (0 keeps all), but those in `protect` (one being exported); returns their ids. The
    manifest goes first, so no checkpoint is ever seen complete with a part missing."""
    complete = complete_checkpoints(directory, num_shards)
    if keep <= 0 or len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    gone = sorted(c for c in _ids_on_disk(directory, num_shards) if c < oldest_kept and c not in protect)
    for c in gone:
        manifest_path(directory, c).unlink(missing_ok=True)
        dense_path(directory, c).unlink(missing_ok=True)
        for shard in _shard_folders(directory, num_shards):
            shutil.rmtree(ps_dir(directory, shard) / checkpoint_name(c), ignore_errors=True)
    return gone


def remove_all(directory: Path) -> None:
    """Delete everything in `directory` but the folder itself, which may be a mount point."""
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def complete_checkpoints(directory: Path, num_shards: int) -> list[int]:
    """Ids of the complete checkpoints, newest first."""
    if not directory.is_dir():
        return []
    ids = sorted((parse_checkpoint_name(p.stem) for p in directory.glob(f"{CHECKPOINT_GLOB}.json")),
                 reverse=True)
    return [c for c in ids if is_complete(directory, c, num_shards)]


def _ids_on_disk(directory: Path, num_shards: int) -> set[int]:
    """Every checkpoint id that has any part on disk (leftovers of failed saves included)."""
    names = [p.stem for p in directory.glob(f"{CHECKPOINT_GLOB}.json")]
    names += [p.stem.removeprefix("dense-") for p in (directory / "trainer").glob("dense-*.pt")]
    for shard in _shard_folders(directory, num_shards):
        names += [p.name for p in ps_dir(directory, shard).glob(CHECKPOINT_GLOB)]
    return {parse_checkpoint_name(name) for name in names}


def _shard_folders(directory: Path, num_shards: int) -> range:
    """Shard folders that may hold snapshots: this run's, and those of a run with more
    shards that it resumed from."""
    on_disk = [int(p.name.removeprefix("ps-")) for p in directory.glob("ps-*") if p.name[3:].isdigit()]
    return range(max([num_shards, *(s + 1 for s in on_disk)]))
