"""The oracle: the planner (numba kernels) and the service streaming its directives.

numba's cache goes to the user's cache folder (`common.numba_cache`), set here before any
module of this package imports numba.
"""

from __future__ import annotations

from common.numba_cache import NUMBA_CACHE_ENV, numba_cache_dir, use_user_cache

__all__ = ["NUMBA_CACHE_ENV", "numba_cache_dir"]

use_user_cache()
