"""Costs the whole suite shares, paid once per run rather than once per test worker.

The planner's numba kernels compile in about 20 s, once per version of their sources, into
the user's cache (`oracle.numba_cache_dir`); every oracle a test starts, and every test that
plans in process, then loads them in under a second. On a fresh machine (CI) the pytest-xdist
workers would each start compiling at once, and so would the oracles of the first cluster
tests. So the controller starts the compile as pytest starts, in two processes under one
lock, while its workers start and collect; a worker waits for the lock before its first test
that plans, then loads what was compiled (or compiles it, if a compiler died). The tests
that plan nothing run meanwhile."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.spec import MODES
from tests.tls_fixtures import TlsFiles, make_tls_files

ROOT = Path(__file__).resolve().parents[1]

# The suite starts hundreds of interpreters (roles, launchers, benchmarks, workers). Where the
# environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE, as many container images set
# it), each would compile every module it imports from source: the project's own cost 0.25 s
# a process here, and torch's 3 s where pip installed it without bytecode, as the README's
# test command does. So the suite and every process it starts write them (docs/testing.md,
# "Bytecode"); an empty value is unset to Python.
os.environ["PYTHONDONTWRITEBYTECODE"] = ""
sys.dont_write_bytecode = False


def _compile_lock() -> str:
    from oracle import NUMBA_CACHE_ENV

    cache = os.environ[NUMBA_CACHE_ENV]
    os.makedirs(cache, exist_ok=True)
    return os.path.join(cache, ".compiling.lock")


#: What each compiler process started by `pytest_configure` compiles: the bagpipe kernels
#: take most of the time, the other modes' compile beside them on the second core.
_COMPILERS = (("bagpipe",), tuple(m for m in MODES if m != "bagpipe"))


def pytest_configure(config: pytest.Config) -> None:
    """In the controller (or a run without workers): start compiling the kernels at once,
    in processes that share one lock on the compile lock file and hold it until they end."""
    if hasattr(config, "workerinput") or config.option.collectonly or _plans_nothing(config.args, config.rootpath):
        return
    from oracle.compiled import is_compiled

    if all(is_compiled(mode) for mode in MODES):
        return
    with open(_compile_lock(), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # shared with the children: released when the last one exits
        for modes in _COMPILERS:
            code = f"from oracle.compiled import compile_planner\nfor m in {modes!r}: compile_planner(m)"
            subprocess.Popen([sys.executable, "-c", code], pass_fds=(lock.fileno(),), stdin=subprocess.DEVNULL,
                             cwd=ROOT)


#: Tests that never plan, in process or in an oracle they start: they run while the kernels
#: compile (a run with cold kernels would otherwise leave a core idle for about 15 s).
_PLAN_NOTHING = ("tests/ps/", "tests/common/")


def _plans_nothing(args: list[str], root: Path) -> bool:
    """Whether every path pytest was given lies in `_PLAN_NOTHING` (`pytest tests/ps`)."""
    paths = [(Path.cwd() / a.split("::")[0]).resolve() for a in args]
    folders = [(root / f).resolve() for f in _PLAN_NOTHING]
    return bool(paths) and all(any(p.is_relative_to(f) for f in folders) for p in paths)


class _Kernels:
    """Waits once per worker, before its first test that plans, until the kernels are in
    numba's cache (compiling them itself if the compilers died)."""

    ready = False

    @classmethod
    def wait(cls) -> None:
        from oracle.compiled import compile_planner, is_compiled

        if not all(is_compiled(mode) for mode in MODES):
            with open(_compile_lock(), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # wait for the compilers, then load what they compiled
                for mode in MODES:
                    compile_planner(mode)
        cls.ready = True


@pytest.fixture(autouse=True)
def compiled_planner(request: pytest.FixtureRequest) -> None:
    if not _Kernels.ready and not request.node.nodeid.startswith(_PLAN_NOTHING):
        _Kernels.wait()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))
