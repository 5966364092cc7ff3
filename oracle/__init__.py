"""The oracle: the planner (numba kernels) and the service streaming its directives.

numba keeps compiled kernels beside their source (``oracle/__pycache__``) unless
NUMBA_CACHE_DIR names a folder, and it reads that variable once, when it is first imported.
So this package sets it, before any of its modules imports numba, to the user's cache
folder unless the user chose one (and tells numba directly if it came first): a checkout
stays clean, and a read-only one still caches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

NUMBA_CACHE_ENV = "NUMBA_CACHE_DIR"


def numba_cache_dir(environ: Mapping[str, str]) -> Path:
    """$NUMBA_CACHE_DIR if set, else $XDG_CACHE_HOME/bagpipe/numba, else ~/.cache/bagpipe/numba."""
    if environ.get(NUMBA_CACHE_ENV):
        return Path(environ[NUMBA_CACHE_ENV])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bagpipe" / "numba"


os.environ[NUMBA_CACHE_ENV] = str(numba_cache_dir(os.environ))
if "numba" in sys.modules:  # imported before this package: it has read the variable already
    sys.modules["numba"].config.CACHE_DIR = os.environ[NUMBA_CACHE_ENV]
