"""Where numba keeps compiled kernels: the user's cache folder, not beside the source.

numba keeps compiled kernels beside their source (``__pycache__``) unless NUMBA_CACHE_DIR
names a folder, and it reads that variable once, when it is first imported. So every
package with numba kernels (the planner's in `oracle`, the data converter's in
`common.data.kernels`) calls `use_user_cache` before it imports numba: a checkout stays
clean, and a read-only one still caches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

NUMBA_CACHE_ENV = "NUMBA_CACHE_DIR"


def cache_root(environ: Mapping[str, str]) -> Path:
    """The user's bagpipe cache folder: $XDG_CACHE_HOME/bagpipe, else ~/.cache/bagpipe."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bagpipe"


def numba_cache_dir(environ: Mapping[str, str]) -> Path:
    """$NUMBA_CACHE_DIR if set, else `cache_root`/numba."""
    if environ.get(NUMBA_CACHE_ENV):
        return Path(environ[NUMBA_CACHE_ENV])
    return cache_root(environ) / "numba"


def use_user_cache() -> None:
    """Point numba's cache at `numba_cache_dir` unless the user chose one (and tell numba
    directly if it was imported first: it has read the variable already)."""
    os.environ[NUMBA_CACHE_ENV] = str(numba_cache_dir(os.environ))
    if "numba" in sys.modules:
        sys.modules["numba"].config.CACHE_DIR = os.environ[NUMBA_CACHE_ENV]
