"""Shard checkpoints on disk: one directory per checkpoint, published by an atomic rename.

A checkpoint is written into ``<dir>/.tmp-<name>`` (arrays as .npy, then ``meta.json``
last), fsynced, and renamed to ``<dir>/<name>``; a crash at any point leaves either the
previous state or a complete checkpoint, never a torn one. Temporary leftovers are removed
on the next save.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from common.checkpoints import CHECKPOINT_GLOB, checkpoint_name, parse_checkpoint_name, ps_dir
from common.errors import NotFound
from common.files import fsync_folder
from ps.store import Snapshot

_ARRAYS = ("local", "rows", "state", "versions")


def save_snapshot(directory: Path, checkpoint_id: int, snap: Snapshot, meta: dict) -> tuple[Path, int]:
    """Write `snap` atomically; returns the final path and the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(checkpoint_id)
    tmp = directory / f".tmp-{checkpoint_name(checkpoint_id)}"
    # Only this checkpoint's leftover: another checkpoint's may be being written right now
    # (reports come off the critical path); a dead process's are `remove_leftovers`'.
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    written = 0
    try:
        for name in _ARRAYS:
            written += _write_fsynced(tmp / f"{name}.npy", getattr(snap, name))
        body = orjson.dumps({**meta, "checkpoint": checkpoint_id, "rows": int(len(snap.local))})
        written += _write_fsynced(tmp / "meta.json", body)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back at once
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_folder(directory)
    return final, written


def load_snapshot(directory: Path, checkpoint_id: int) -> tuple[Snapshot, dict]:
    """Read a complete checkpoint; NotFound if it is absent or incomplete."""
    files = snapshot_files(directory, checkpoint_id)
    if not files["meta"].is_file():
        raise NotFound(f"no complete checkpoint {checkpoint_id} in {directory}")
    meta = orjson.loads(files["meta"].read_bytes())
    arrays = {name: np.load(files[name], allow_pickle=False) for name in _ARRAYS}
    return Snapshot(**arrays), meta


#: Rows read at a time when a snapshot is resharded: bounded memory whatever its size.
RESHARD_CHUNK_ROWS = 1 << 20


def snapshot_shards(root: Path, checkpoint_id: int) -> int | None:
    """How many shards took checkpoint `checkpoint_id`, from the snapshots under the
    checkpoint folder `root` (each says so in its meta); None if no snapshot of it is here."""
    for folder in sorted(root.glob("ps-*")):
        meta = snapshot_files(folder, checkpoint_id)["meta"]
        if meta.is_file():
            return int(orjson.loads(meta.read_bytes())["num_shards"])
    return None


def resharded(
    root: Path, checkpoint_id: int, shard: int, num_shards: int, chunk_rows: int = RESHARD_CHUNK_ROWS
) -> Iterator[Snapshot]:
    """The rows of checkpoint `checkpoint_id` that shard `shard` of `num_shards` owns (key %
    num_shards), read from the snapshots of the shards that took it, however many they were,
    `chunk_rows` at a time (memory-mapped: never a whole snapshot in memory). NotFound naming
    the first snapshot missing: each of them must be under `root`."""
    old = snapshot_shards(root, checkpoint_id)
    if old is None:
        raise NotFound(f"no snapshot of checkpoint {checkpoint_id} under {root}")
    folders = [ps_dir(root, s) for s in range(old)]
    absent = [f for f in folders if not snapshot_files(f, checkpoint_id)["meta"].is_file()]
    if absent:
        raise NotFound(f"checkpoint {checkpoint_id} was taken by {old} shards; moving its rows to "
                       f"{num_shards} needs every snapshot of it, and {absent[0]} has none")
    for s, folder in enumerate(folders):
        files = snapshot_files(folder, checkpoint_id)
        arrays = {name: np.load(files[name], mmap_mode="r", allow_pickle=False) for name in _ARRAYS}
        for start in range(0, len(arrays["local"]), chunk_rows):
            part = {name: np.asarray(a[start : start + chunk_rows]) for name, a in arrays.items()}
            keys = part["local"] * old + s
            mine = keys % num_shards == shard
            yield Snapshot(local=keys[mine] // num_shards, rows=part["rows"][mine], state=part["state"][mine],
                           versions=part["versions"][mine])


def snapshot_files(directory: Path, checkpoint_id: int) -> dict[str, Path]:
    """The files of a snapshot: "meta" (JSON, present once the snapshot is complete) and one
    .npy per `Snapshot` field ("local" sorted ascending, "rows", "state", "versions")."""
    path = directory / checkpoint_name(checkpoint_id)
    return {"meta": path / "meta.json", **{name: path / f"{name}.npy" for name in _ARRAYS}}


def saved_checkpoint(directory: Path, checkpoint_id: int) -> tuple[Path, int] | None:
    """Path and size in bytes of a complete checkpoint on disk, or None."""
    path = directory / checkpoint_name(checkpoint_id)
    if not (path / "meta.json").is_file():
        return None
    return path, sum(f.stat().st_size for f in path.iterdir())


def list_checkpoints(directory: Path) -> list[int]:
    """Ids of the complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    ids = []
    for path in directory.glob(CHECKPOINT_GLOB):
        if (path / "meta.json").is_file():
            ids.append(parse_checkpoint_name(path.name))
    return sorted(ids)


def remove_after(directory: Path, checkpoint_id: int) -> list[int]:
    """Delete the checkpoints newer than `checkpoint_id` (another run's, or one abandoned by
    a restart); returns their ids."""
    gone = [c for c in list_checkpoints(directory) if c > checkpoint_id]
    for c in gone:
        shutil.rmtree(directory / checkpoint_name(c))
    return gone


def remove_leftovers(directory: Path) -> None:
    """Delete half-written snapshots of an earlier process (at start-up, before any write)."""
    for leftover in directory.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_before(directory: Path, checkpoint_id: int) -> list[int]:
    """Delete the checkpoints older than `checkpoint_id` (no longer kept); returns their ids."""
    gone = [c for c in list_checkpoints(directory) if c < checkpoint_id]
    for c in gone:
        shutil.rmtree(directory / checkpoint_name(c), ignore_errors=True)
    return gone


def _write_fsynced(path: Path, data: np.ndarray | bytes) -> int:
    with open(path, "wb") as fh:
        if isinstance(data, bytes):
            fh.write(data)
        else:
            np.save(fh, data, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
        return fh.tell()


