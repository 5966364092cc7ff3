"""The planner's compiled kernels: cached in the user's folder, never in the source tree,
compiled afresh after an edit to any of their files, and compiled ahead for exactly the
argument types a real run uses."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oracle import NUMBA_CACHE_ENV, numba_cache_dir

ROOT = Path(__file__).resolve().parents[2]


def test_the_cache_folder_is_the_users_unless_they_chose_one() -> None:
    assert numba_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/bagpipe/numba")
    assert numba_cache_dir({}) == Path.home() / ".cache" / "bagpipe" / "numba"
    assert numba_cache_dir({NUMBA_CACHE_ENV: "/mine", "XDG_CACHE_HOME": "/x"}) == Path("/mine")


def run_python(code: str, xdg_cache: Path, root: Path = ROOT) -> str:
    """Run `code` in a fresh interpreter at `root` whose only cache setting is
    XDG_CACHE_HOME (this process set NUMBA_CACHE_DIR when it imported the oracle)."""
    env = {k: v for k, v in os.environ.items() if k != NUMBA_CACHE_ENV} | {"XDG_CACHE_HOME": str(xdg_cache)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def compiled_files(directory: Path) -> dict[Path, int]:
    """numba's index and code files under `directory`, with their modification times."""
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*.nb[ic]")}


@pytest.mark.parametrize("numba_first", [False, True], ids=["oracle-first", "numba-first"])
def test_compiling_writes_into_the_users_cache_and_not_the_source_tree(tmp_path: Path, numba_first: bool) -> None:
    source_before = compiled_files(ROOT / "oracle")
    imports = ["from oracle.compiled import compile_planner, is_compiled", "import numba"]
    out = run_python(
        "\n".join([*(imports[::-1] if numba_first else imports), "print(numba.config.CACHE_DIR)",
                   'assert not is_compiled("static-cache")', 'compile_planner("static-cache")',
                   'assert is_compiled("static-cache")']),
        tmp_path,
    )
    cache = tmp_path / "bagpipe" / "numba"
    assert out.split() == [str(cache)]
    assert any(p.name.startswith("modes._swap_versions-") for p in compiled_files(cache)), list(cache.rglob("*"))
    assert compiled_files(ROOT / "oracle") == source_before


KERNELS = ROOT / "oracle" / "kernels"


def imported_modules(source: str) -> set[str]:
    """The modules a source file imports anywhere (relative imports left out)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_the_kernels_import_no_source_outside_their_package(path: Path) -> None:
    # their cache's folder is named by a hash of the files of oracle/kernels and of the
    # prefetch intrinsic (cache.py there): code of the project outside them could change
    # theirs unseen (common.jit is the caching machinery, compiled into no kernel)
    foreign = {
        m for m in imported_modules(path.read_text())
        if not m.startswith("oracle.kernels.") and m not in {"common.cpu_prefetch", "common.jit"}
        and m.partition(".")[0] not in {*sys.stdlib_module_names, "numpy", "numba", "llvmlite"}
    }
    assert not foreign


def test_an_edit_to_one_kernel_file_recompiles_the_kernels_of_the_others(tmp_path: Path) -> None:
    """`ingest` (ingest.py) compiles in NEVER from layout.py, and its signature names
    `BagpipeState` of state.py. numba's own cache, stamped with ingest.py alone, would load
    stale code after NEVER changed, as it does for `plain` here, and would fail to read its
    index once the class is renamed; the kernels' cache compiles `ingest` afresh after each
    edit, and `is_cached` says so before."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(KERNELS, src / "oracle" / "kernels", ignore=ignore)
    shutil.copy(ROOT / "oracle" / "__init__.py", src / "oracle")
    (src / "common").mkdir()
    for name in ("__init__.py", "numba_cache.py", "jit.py", "cpu_prefetch.py"):  # the cache, the intrinsic
        shutil.copy(ROOT / "common" / name, src / "common")
    (src / "plain.py").write_text(textwrap.dedent(
        """
        import numba
        from oracle.kernels.layout import NEVER

        @numba.njit(cache=True)
        def plain():
            return NEVER
        """
    ))
    probe = """
        import numpy as np
        from oracle.kernels.ingest import ingest
        from oracle.kernels.cache import is_cached
        from oracle.kernels.state import new_state
        from plain import plain

        cached = is_cached(ingest)
        state = new_state(2, 4, 16, 8)
        ingest(state, 0, np.array([0, 3]), np.array([0, 1]), 0, 2, 0)  # keys 0 and 1, one pair each
        compiled = sum(ingest.stats.cache_misses.values())
        print(cached, compiled, state.occ_next_use[0], plain())
    """

    def run() -> tuple[bool, int, int, int]:
        cached, compiled, never, stale = run_python(probe, tmp_path / "cache", root=src).split()
        return cached == "True", int(compiled), int(never), int(stale)

    def edit(name: str, old: str, new: str) -> None:
        path = src / "oracle" / "kernels" / name
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    assert run() == (False, 1, 1 << 62, 1 << 62)
    assert run() == (True, 0, 1 << 62, 1 << 62)
    edit("layout.py", "NEVER = np.int64(1 << 62)", "NEVER = np.int64(1 << 61)")
    assert run() == (False, 1, 1 << 61, 1 << 62)
    assert run() == (True, 0, 1 << 61, 1 << 62)
    for name in ("state.py", "ingest.py"):
        edit(name, "BagpipeState", "RenamedState")
    assert run() == (False, 1, 1 << 61, 1 << 62)
    assert run() == (True, 0, 1 << 61, 1 << 62)


@pytest.mark.slow
@pytest.mark.nightly
def test_a_real_run_compiles_nothing_after_compile_planner(tmp_path: Path) -> None:
    """About 15 s on a quiet machine: the bagpipe kernels, compiled from cold."""
    run_python('from oracle.compiled import compile_planner\ncompile_planner("bagpipe")', tmp_path)
    out = run_python(
        """
        import importlib
        import pkgutil

        import numpy as np
        from numba.core.dispatcher import Dispatcher
        import oracle.kernels
        from oracle.planner import Planner, PlannerConfig

        config = PlannerConfig(num_trainers=3, lookahead=5, prefetch_lead=3, capacity=40, checkpoint_every=4,
                               first_iteration=8)
        planner = Planner(config)
        rng = np.random.default_rng(1)
        for _ in range(30):
            planner.push(rng.zipf(1.3, size=(12, 3)) % 5000)
        planner.finish()
        files = [importlib.import_module(f"oracle.kernels.{m.name}")
                 for m in pkgutil.iter_modules(oracle.kernels.__path__)]
        kernels = {id(f): f for m in files for f in vars(m).values()
                   if isinstance(f, Dispatcher)}.values()
        print(len(kernels), sum(sum(f.stats.cache_misses.values()) for f in kernels))
        """,
        tmp_path,
    )
    kernels, compiled = map(int, out.split())
    assert kernels > 10 and compiled == 0
