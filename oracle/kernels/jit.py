"""How the kernels are compiled: numba's ``njit``, with its on-disk cache in a folder of its
own for each version of this package's sources.

numba's cache (``cache=True``) keeps an index file per function, stamped with a hash of that
function's own source file, and loads the compiled code while the stamp matches
(numba/core/caching.py: ``_SourceFileBackedLocatorMixin.get_source_stamp``,
``IndexDataCacheFile._load_index``). It looks at no other file: not at those of the helpers
a kernel inlines or calls, nor at those of the module-level constants it reads, though both
are compiled into the kernel. A kernel that inlines a heap operation from one file and reads
a column constant from another would load its stale code after either file changed. And it
unpickles an index before it compares the stamp: an index whose signatures name a class
since renamed or moved (the state's NamedTuple) fails to load with an AttributeError instead
of counting as stale.

So `kernel` and `inlined` cache each kernel in a folder named by a hash of every ``.py``
file of this package (`sources_digest`), in the user's cache folder that oracle/__init__.py
chooses (``oracle-kernels/<digest>``, the same for every checkout of the same sources): after
an edit to any of them, every kernel is looked up in a new, empty folder and compiled afresh
on its first call, and no index written by other sources is ever read. The folders of
earlier versions stay until someone deletes them (about 2 MB each; numba leaves the files
of a function behind as well whenever an edit moves its first line). The
kernels import nothing but numpy, numba, llvmlite, the standard library and this package
(tests/oracle/test_compiled.py checks), so these files are all the source their code
depends on.
"""

from __future__ import annotations

import functools
import hashlib
import os
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
    """``numba.njit(cache=True)``, cached in the folder of this package's sources: a
    function compiled on its own, called from Python or from other kernels."""
    return _cached_by_sources(nb.njit(fn))


def inlined(fn: F) -> F:
    """``numba.njit(cache=True, inline="always")``, cached in the folder of this package's
    sources: a helper compiled into each kernel that calls it (oracle/kernels/__init__.py,
    "Speed")."""
    return _cached_by_sources(nb.njit(inline="always")(fn))


def is_cached(dispatcher: Any) -> bool:
    """Whether numba's cache holds code of `dispatcher` for its current sources: numba's own
    test of its index file (present, written by this numba version, for the function's
    file; a kernel's index is in the folder of its package's sources). numba has no public
    call for it; these are the internals of numba 0.68 (pinned), and
    tests/oracle/test_compiled.py notices when they change."""
    return bool(dispatcher._cache._cache_file._load_index())


@functools.cache
def sources_digest() -> str:
    """A hash of the names and contents of this package's ``.py`` files, read once a
    process: the sources its kernels were imported from."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.glob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:20]


class _SourcesFolder:
    """Locator mixin: numba's folder for the function, then one named by `sources_digest`."""

    def get_cache_path(self) -> str:
        return os.path.join(super().get_cache_path(), sources_digest())  # type: ignore[misc]


class _UserProvidedLocator(_SourcesFolder, UserProvidedCacheLocator):
    """In the user's cache folder: one folder per version of the sources, wherever the
    checkout is (numba's own subfolder is named by a hash of the source folder's path, so
    every fresh clone, CI's included, would compile the kernels again)."""

    def get_cache_path(self) -> str:
        return os.path.join(nb.config.CACHE_DIR, "oracle-kernels", sources_digest())


class _InTreeLocator(_SourcesFolder, InTreeCacheLocator):
    pass


class _UserWideLocator(_SourcesFolder, UserWideCacheLocator):
    pass


class _KernelCacheImpl(CompileResultCacheImpl):
    # numba's own order, less the IPython and zip locators: the kernels live in files
    _locator_classes = [_UserProvidedLocator, _InTreeLocator, _UserWideLocator]


class _KernelCache(FunctionCache):
    _impl_class = _KernelCacheImpl


def _cached_by_sources(dispatcher: Any) -> Any:
    # what njit(cache=True) does (Dispatcher.enable_caching), in the sources' folder
    if isinstance(dispatcher, Dispatcher):  # NUMBA_DISABLE_JIT: the plain function
        dispatcher._cache = _KernelCache(dispatcher.py_func)
    return dispatcher
