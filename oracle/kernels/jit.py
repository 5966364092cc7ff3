"""How the kernels are compiled: numba's ``njit`` with an on-disk cache stamped with every
source file of this package.

numba's cache (``cache=True``) keeps an index file per function, stamped with a hash of that
function's own source file, and loads the compiled code while the stamp matches
(numba/core/caching.py: ``_SourceFileBackedLocatorMixin.get_source_stamp``,
``IndexDataCacheFile._load_index``). It looks at no other file: not at those of the helpers
a kernel inlines or calls, nor at those of the module-level constants it reads, though both
are compiled into the kernel. A kernel that inlines a heap operation from one file and reads
a column constant from another would load its stale code after either file changed.

So the kernels are compiled with `kernel` and `inlined`, which stamp the index with numba's
stamp and a hash of every ``.py`` file of this package (`sources_digest`): after any edit to
any of them every kernel's index is stale, and each kernel is compiled afresh the first time
it is called. Nothing else changes: the index and code files keep numba's names and folder
(the one oracle/__init__.py chooses), a stale index is rewritten in place, and its code
files are overwritten. The kernels import nothing but numpy, numba, llvmlite, the standard
library and this package (tests/oracle/test_compiled.py checks), so these files are all the
source their code depends on.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numba as nb
from numba.core.caching import (
    CompileResultCacheImpl,
    FunctionCache,
    InTreeCacheLocator,
    UserProvidedCacheLocator,
    UserWideCacheLocator,
)
from numba.core.dispatcher import Dispatcher

F = TypeVar("F", bound=Callable[..., Any])

PACKAGE = Path(__file__).resolve().parent


def kernel(fn: F) -> F:
    """``numba.njit(cache=True)``, cached under this package's stamp: a function compiled on
    its own, called from Python or from other kernels."""
    return _stamped(nb.njit(fn))


def inlined(fn: F) -> F:
    """``numba.njit(cache=True, inline="always")``, cached under this package's stamp: a
    helper compiled into each kernel that calls it (oracle/kernels/__init__.py, "Speed")."""
    return _stamped(nb.njit(inline="always")(fn))


def is_cached(dispatcher: Any) -> bool:
    """Whether numba's cache holds code of `dispatcher` for its current sources: numba's own
    test of its index file (present, written by this numba version, with this stamp). numba
    has no public call for it; these are the internals of numba 0.68 (pinned), and
    tests/oracle/test_compiled.py notices when they change."""
    return bool(dispatcher._cache._cache_file._load_index())


def sources_digest(folder: Path = PACKAGE) -> bytes:
    """SHA-256 of the names and contents of the ``.py`` files in `folder`, re-read when one
    of them changes (as numba re-reads a source file)."""
    files = sorted(folder.glob("*.py"))
    return _digest(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@functools.lru_cache(maxsize=None)
def _digest(files: tuple[tuple[str, int, int], ...]) -> bytes:
    h = hashlib.sha256()
    for path, _, _ in files:
        data = Path(path).read_bytes()
        h.update(f"{Path(path).name}\0{len(data)}\0".encode())
        h.update(data)
    return h.digest()


class _PackageStamp:
    """Locator mixin: numba's stamp (the function's own file) and `sources_digest`."""

    def get_source_stamp(self) -> tuple[Any, bytes]:
        return super().get_source_stamp(), sources_digest()  # type: ignore[misc]


class _UserProvidedLocator(_PackageStamp, UserProvidedCacheLocator):
    pass


class _InTreeLocator(_PackageStamp, InTreeCacheLocator):
    pass


class _UserWideLocator(_PackageStamp, UserWideCacheLocator):
    pass


class _KernelCacheImpl(CompileResultCacheImpl):
    # numba's own order, less the IPython and zip locators: the kernels live in files
    _locator_classes = [_UserProvidedLocator, _InTreeLocator, _UserWideLocator]


class _KernelCache(FunctionCache):
    _impl_class = _KernelCacheImpl


def _stamped(dispatcher: Any) -> Any:
    # what njit(cache=True) does (Dispatcher.enable_caching), with the package's stamp
    if isinstance(dispatcher, Dispatcher):  # NUMBA_DISABLE_JIT: the plain function
        dispatcher._cache = _KernelCache(dispatcher.py_func)
    return dispatcher
