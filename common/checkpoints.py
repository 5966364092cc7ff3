"""Where a cluster's checkpoint lives on disk, and which one is the latest complete.

Checkpoint c is made of one snapshot per PS shard (``<dir>/ps-<s>/ckpt-<c>/``), the dense
model and optimizer of trainer 0 (``<dir>/trainer/dense-<c>.pt``) and, written last, the
manifest ``<dir>/ckpt-<c>.json``. Only a checkpoint whose manifest and parts all exist is
complete; recovery ignores the others (DESIGN §9).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from ps.checkpoint import checkpoint_name


def ps_dir(directory: Path, shard: int) -> Path:
    return directory / f"ps-{shard}"


def dense_path(directory: Path, checkpoint_id: int) -> Path:
    return directory / "trainer" / f"dense-{checkpoint_id:010d}.pt"


def manifest_path(directory: Path, checkpoint_id: int) -> Path:
    return directory / f"{checkpoint_name(checkpoint_id)}.json"


def write_manifest(directory: Path, checkpoint_id: int, num_shards: int, extra: dict[str, Any]) -> Path:
    """Publish checkpoint `checkpoint_id` as complete (temporary file + rename)."""
    path = manifest_path(directory, checkpoint_id)
    body = {"checkpoint": checkpoint_id, "shards": num_shards, "time": time.time(), **extra}
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(orjson.dumps(body))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def is_complete(directory: Path, checkpoint_id: int, num_shards: int) -> bool:
    parts = [manifest_path(directory, checkpoint_id), dense_path(directory, checkpoint_id)]
    parts += [ps_dir(directory, s) / checkpoint_name(checkpoint_id) / "meta.json" for s in range(num_shards)]
    return all(p.is_file() for p in parts)


def latest_complete(directory: Path, num_shards: int) -> int | None:
    """The newest complete checkpoint's iteration, or None."""
    ids = sorted(
        (int(p.stem.removeprefix("ckpt-")) for p in directory.glob("ckpt-*.json")), reverse=True
    ) if directory.is_dir() else []
    return next((c for c in ids if is_complete(directory, c, num_shards)), None)
