"""Which iterations are checkpoints, which checkpoints are complete, and which ones retention
deletes (real files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.checkpoints import (
    checkpoint_name,
    dense_path,
    first_checkpoint_from,
    is_checkpoint,
    latest_complete,
    manifest_path,
    parse_checkpoint_name,
    prune,
    ps_dir,
    remove_all,
    write_manifest,
)
from ps.checkpoint import list_checkpoints, save_snapshot
from ps.store import Snapshot

SHARDS = 2


def _snapshot(rows: int) -> Snapshot:
    return Snapshot(
        local=np.arange(rows, dtype=np.int64), rows=np.ones((rows, 4), np.float32),
        state=np.zeros((rows, 1), np.float32), versions=np.zeros(rows, np.int64),
    )


def _save(directory: Path, c: int, *, shards: tuple[int, ...] = (0, 1), dense: bool = True, manifest: bool = True) -> None:
    for shard in shards:
        save_snapshot(ps_dir(directory, shard), c, _snapshot(3), {"shard": shard})
    if dense:
        dense_path(directory, c).parent.mkdir(parents=True, exist_ok=True)
        dense_path(directory, c).write_bytes(b"dense")
    if manifest:
        write_manifest(directory, c, SHARDS, {})


def _ids_left(directory: Path) -> dict[str, list[int]]:
    return {
        "manifests": sorted(int(p.stem.removeprefix("ckpt-")) for p in directory.glob("ckpt-*.json")),
        "dense": sorted(int(p.stem.removeprefix("dense-")) for p in (directory / "trainer").glob("dense-*.pt")),
        **{f"ps-{s}": list_checkpoints(ps_dir(directory, s)) for s in range(SHARDS)},
    }


def test_checkpoint_schedule() -> None:
    assert [c for c in range(20) if is_checkpoint(c, 5)] == [4, 9, 14, 19]
    assert not any(is_checkpoint(c, 0) for c in range(20))
    assert [first_checkpoint_from(i, 5) for i in (0, 4, 5, 9, 10)] == [4, 4, 9, 9, 14]
    far = np.array([0, 3, 2**62], dtype=np.int64)
    assert first_checkpoint_from(far, 4).tolist() == [3, 3, 2**62 + 3]


def test_checkpoint_names_sort_as_their_ids_and_give_them_back() -> None:
    names = [checkpoint_name(c) for c in (9, 10, 123)]
    assert names == sorted(names) and [parse_checkpoint_name(n) for n in names] == [9, 10, 123]


def test_a_checkpoint_missing_any_part_is_not_complete(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    _save(tmp_path, 9, manifest=False)
    _save(tmp_path, 14, shards=(0,))
    _save(tmp_path, 19, dense=False)
    assert latest_complete(tmp_path, SHARDS) == 4
    assert latest_complete(tmp_path / "absent", SHARDS) is None


def test_prune_keeps_the_newest_complete_ones_and_what_is_newer(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    _save(tmp_path, 9, shards=(1,), manifest=False)  # a failed save before the kept ones
    _save(tmp_path, 14)
    _save(tmp_path, 19, dense=False)  # incomplete, between the kept ones
    _save(tmp_path, 24)
    _save(tmp_path, 29, shards=(0,), manifest=False)  # newer than every complete one: a PS may rejoin from it
    assert prune(tmp_path, SHARDS, keep=2) == [4, 9]
    assert _ids_left(tmp_path) == {"manifests": [14, 19, 24], "dense": [14, 24, 29], "ps-0": [14, 19, 24, 29], "ps-1": [14, 19, 24]}
    assert latest_complete(tmp_path, SHARDS) == 24
    assert prune(tmp_path, SHARDS, keep=2) == []


def test_prune_with_keep_0_or_too_few_complete_deletes_nothing(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    _save(tmp_path, 9, manifest=False)
    _save(tmp_path, 14)
    before = _ids_left(tmp_path)
    assert prune(tmp_path, SHARDS, keep=0) == []
    assert prune(tmp_path, SHARDS, keep=2) == []
    assert _ids_left(tmp_path) == before
    assert prune(tmp_path, SHARDS, keep=1) == [4, 9]
    assert not (ps_dir(tmp_path, 0) / checkpoint_name(9)).exists() and not manifest_path(tmp_path, 4).exists()


def test_remove_all_keeps_the_folder_itself(tmp_path: Path) -> None:
    """It may be a mount point, which cannot be removed."""
    _save(tmp_path, 4)
    (tmp_path / ".leftover.tmp").write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    remove_all(tmp_path)
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == [] and outside.is_dir()
