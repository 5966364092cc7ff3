"""How the project's numba kernels are compiled and cached: ``njit``, with its on-disk cache
in a folder of its own for each version of the sources the kernels are compiled from.

numba's cache (``cache=True``) keeps an index file per function, stamped with a hash of that
function's own source file, and loads the compiled code while the stamp matches
(numba/core/caching.py: ``_SourceFileBackedLocatorMixin.get_source_stamp``,
``IndexDataCacheFile._load_index``). It looks at no other file: not at those of the helpers
a kernel inlines or calls (an LLVM intrinsic such as `common.cpu_prefetch`'s among them), nor
at those of the module-level constants it reads, though all are compiled into the kernel. A
kernel that inlines a heap operation from one file and reads a column constant from another
would load its stale code after either file changed. And it unpickles an index before it
compares the stamp: an index whose signatures name a class since renamed or moved (the
planner's state NamedTuple) fails to load with an AttributeError instead of counting as stale.

So a `KernelCache` names every source file its kernels are compiled from, and caches each of
its kernels in a folder named by a hash of those files (`KernelCache.digest`), in the user's
cache folder (`common.numba_cache`: ``<name>/<digest>``, the same for every checkout of the
same sources): after an edit to any of them, every kernel is looked up in a new, empty folder
and compiled afresh, and no index written by other sources is ever read. The folders of
earlier versions stay until someone deletes them (about 2 MB each). Each user lists its
sources: the planner's kernels (`oracle.kernels.cache`) every file of their package and
`common.cpu_prefetch`, the trainer's (`trainer.kernels`) their file and the same intrinsic;
tests/oracle/test_compiled.py checks that the planner's import nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Sequence
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

#: The file of `common.cpu_prefetch`, a source of every kernel that prefetches.
CPU_PREFETCH = Path(__file__).resolve().parent / "cpu_prefetch.py"


class KernelCache:
    """Kernels compiled from `sources` (called once, when a kernel is first looked up),
    cached in the user's folder ``<name>/<digest of the sources>``."""

    def __init__(self, name: str, sources: Callable[[], Sequence[Path]]) -> None:
        self.name = name
        self._sources = sources
        self._impl = _impl_class(self)

    @functools.cached_property
    def digest(self) -> str:
        """A hash of the names and contents of the sources, read once a process."""
        h = hashlib.sha256()
        for path in sorted(self._sources()):
            data = path.read_bytes()
            h.update(f"{path.name}\0{len(data)}\0".encode())
            h.update(data)
        return h.hexdigest()[:20]

    def kernel(self, fn: F) -> F:
        """``numba.njit(cache=True)`` in this cache: a function compiled on its own, called
        from Python or from other kernels."""
        return self._cached(nb.njit(fn))

    def inlined(self, fn: F) -> F:
        """``numba.njit(cache=True, inline="always")`` in this cache: a helper compiled into
        each kernel that calls it."""
        return self._cached(nb.njit(inline="always")(fn))

    def compiled(self, signatures: list[Any], **options: Any) -> Callable[[F], F]:
        """``numba.njit(signatures, cache=True, **options)`` in this cache: compiled for
        `signatures` when it is defined (loaded from the cache where it holds them)."""

        def decorate(fn: F) -> F:
            dispatcher = self._cached(nb.njit(**options)(fn))
            if isinstance(dispatcher, Dispatcher):
                for signature in signatures:
                    dispatcher.compile(signature)
                dispatcher.disable_compile()  # as njit does with signatures: no others
            return dispatcher

        return decorate

    def _cached(self, dispatcher: Any) -> Any:
        # what njit(cache=True) does (Dispatcher.enable_caching), in this cache's folder
        if isinstance(dispatcher, Dispatcher):  # NUMBA_DISABLE_JIT: the plain function
            dispatcher._cache = _function_cache(self._impl)(dispatcher.py_func)
        return dispatcher


def is_cached(dispatcher: Any) -> bool:
    """Whether numba's cache holds code of `dispatcher` for its current sources: numba's own
    test of its index file (present, written by this numba version, for the function's
    file; a kernel's index is in the folder of its sources). numba has no public call for
    it; these are the internals of numba 0.68 (pinned), and tests/oracle/test_compiled.py
    notices when they change."""
    return bool(dispatcher._cache._cache_file._load_index())


def _impl_class(cache: KernelCache) -> type:
    """numba's cache implementation with locators that add the folder of `cache`'s sources."""

    class SourcesFolder:
        """Locator mixin: numba's folder for the function, then one named by the digest."""

        def get_cache_path(self) -> str:
            return os.path.join(super().get_cache_path(), cache.digest)  # type: ignore[misc]

    class UserProvided(SourcesFolder, UserProvidedCacheLocator):
        """In the user's cache folder: one folder per version of the sources, wherever the
        checkout is (numba's own subfolder is named by a hash of the source folder's path,
        so every fresh clone, CI's included, would compile the kernels again)."""

        def get_cache_path(self) -> str:
            return os.path.join(nb.config.CACHE_DIR, cache.name, cache.digest)

    class InTree(SourcesFolder, InTreeCacheLocator):
        pass

    class UserWide(SourcesFolder, UserWideCacheLocator):
        pass

    class Impl(CompileResultCacheImpl):
        # numba's own order, less the IPython and zip locators: the kernels live in files
        _locator_classes = [UserProvided, InTree, UserWide]

    return Impl


def _function_cache(impl: type) -> type:
    class Cache(FunctionCache):
        _impl_class = impl

    return Cache
