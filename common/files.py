"""Replacing a file so that a reader, or a crash, sees its old content or its new, never part."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, on disk, or keeps what it held: a temporary file, fsync,
    rename. OSError (a full disk, say) leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
