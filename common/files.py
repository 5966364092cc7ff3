"""Replacing a file so that a reader, or a crash, sees its old content or its new, never part."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, on disk, or keeps what it held: a temporary file, fsync,
    rename. OSError (a full disk, say) leaves no temporary file behind."""
    with atomic_file(path) as fh:
        fh.write(data)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file to write in pieces (content too large to hold in memory) that replaces `path`
    only once the block ends without an error; any error, the writer's own included, leaves
    `path` as it was and no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_folder(folder: Path) -> None:
    """Make the names in `folder` durable (a rename into it survives a crash once this returns)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
