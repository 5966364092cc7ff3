"""The files a data spec names, and what identifies their content.

`path` names a file, a folder (its visible files), or a glob pattern (``day_*.gz``,
``part-*.parquet``), or is a list of those; a folder's files and a pattern's matches are
taken in natural order (``day_2`` before ``day_10``), a list's entries in the order written.
A cache is current while every file's name, size and modification time match; the sampled
checksum (`sampled_checksum`) identifies the content without reading every byte.
"""

from __future__ import annotations

import glob
import hashlib
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.errors import ConfigError

SAMPLE_BLOCKS = 16  # blocks read per file for the checksum: first, last and evenly between
SAMPLE_BYTES = 64 << 10
_PATTERN = re.compile(r"[*?[]")


def natural_order(paths: Sequence[Path]) -> list[Path]:
    """``day_2`` before ``day_10``."""
    return sorted(paths, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def entries(path: str | Sequence[str]) -> tuple[str, ...]:
    """The spec's `path` as a tuple of entries (one for a plain string)."""
    return (path,) if isinstance(path, str) else tuple(path)


def is_pattern(entry: str) -> bool:
    return bool(_PATTERN.search(Path(entry).name)) or bool(_PATTERN.search(str(Path(entry).parent)))


def expand(path: str | Sequence[str], keep: Callable[[Path], bool], what: str) -> list[Path]:
    """The files `path` names (see the module docstring); a folder contributes its files
    that `keep` accepts. ConfigError("data.path") for an entry that names nothing, and for a
    file named twice (it would be read twice)."""
    files: list[Path] = []
    for entry in entries(path):
        files += _expand_one(entry, keep, what)
    seen: set[Path] = set()
    for file in files:
        if file in seen:
            raise ConfigError("data.path", f"names {file} twice")
        seen.add(file)
    return files


def _expand_one(entry: str, keep: Callable[[Path], bool], what: str) -> list[Path]:
    if is_pattern(entry):
        matches = [Path(p) for p in glob.glob(entry) if Path(p).is_file() and not Path(p).name.startswith(".")]
        if not matches:
            raise ConfigError("data.path", f"{entry} matches no file")
        return natural_order(matches)
    path = Path(entry)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError("data.path", f"{path} does not exist")
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and keep(p)]
    if not files:
        raise ConfigError("data.path", f"{path} holds no {what}")
    return natural_order(files)


def fingerprint(files: Sequence[Path]) -> list[dict[str, Any]]:
    """Name, size and mtime of every file: a cheap check that what was read from them is
    still current."""
    out = []
    for p in files:
        st = p.stat()
        out.append({"name": p.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def sampled_checksum(files: Sequence[Path]) -> str:
    """blake2b of each file's size and `SAMPLE_BLOCKS` blocks of it (first, last, evenly
    spaced between): what a manifest records of its source's content. Reading every byte
    cost three quarters of the npy reader's time; a changed file almost always changes its
    size, its mtime (checked first) or a sampled block."""
    digest = hashlib.blake2b(digest_size=16)
    for p in files:
        size = p.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        last = max(size - SAMPLE_BYTES, 0)
        with p.open("rb") as f:
            for offset in sorted({last * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
