"""Costs the whole suite shares, paid once per run rather than once per test worker.

The planner's numba kernels compile in about 13 s, once per version of their sources, into
the user's cache (`oracle.numba_cache_dir`); every oracle a test starts, and every test that
plans in process, then loads them in under a second. On a fresh machine (CI) the pytest-xdist
workers would each start compiling at once, and so would the oracles of the first cluster
tests: the first worker here compiles under a lock while the others wait for it.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator

import pytest

from common.spec import MODES
from tests.tls_fixtures import TlsFiles, make_tls_files

# The suite starts hundreds of interpreters (roles, launchers, benchmarks, workers). Where the
# environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE, as many container images set
# it), each would compile every module it imports from source: the project's own cost 0.25 s
# a process here, and torch's 3 s where pip installed it without bytecode, as the README's
# test command does. So the suite and every process it starts write them (docs/testing.md,
# "Bytecode"); an empty value is unset to Python.
os.environ["PYTHONDONTWRITEBYTECODE"] = ""
sys.dont_write_bytecode = False


@pytest.fixture(scope="session", autouse=True)
def compiled_planner() -> Iterator[None]:
    from oracle import NUMBA_CACHE_ENV
    from oracle.compiled import compile_planner, is_compiled

    if all(is_compiled(mode) for mode in MODES):
        yield
        return
    cache = os.environ[NUMBA_CACHE_ENV]
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".compiling.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then load what it compiled
        for mode in MODES:
            compile_planner(mode)
    yield


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))
