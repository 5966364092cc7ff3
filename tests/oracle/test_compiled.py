"""The planner's compiled kernels: cached in the user's folder, never in the source tree,
and compiled ahead for exactly the argument types a real run uses."""

from __future__ import annotations

import os
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


def run_python(code: str, xdg_cache: Path) -> str:
    """Run `code` in a fresh interpreter at the repository root whose only cache setting
    is XDG_CACHE_HOME (this process set NUMBA_CACHE_DIR when it imported the oracle)."""
    env = {k: v for k, v in os.environ.items() if k != NUMBA_CACHE_ENV} | {"XDG_CACHE_HOME": str(xdg_cache)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
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


@pytest.mark.slow
@pytest.mark.nightly
def test_a_real_run_compiles_nothing_after_compile_planner(tmp_path: Path) -> None:
    """About 15 s on a quiet machine: the bagpipe kernels, compiled from cold."""
    run_python('from oracle.compiled import compile_planner\ncompile_planner("bagpipe")', tmp_path)
    out = run_python(
        """
        import numpy as np
        from numba.core.dispatcher import Dispatcher
        from oracle import engine
        from oracle.planner import Planner, PlannerConfig

        config = PlannerConfig(num_trainers=3, lookahead=5, prefetch_lead=3, capacity=40, checkpoint_every=4,
                               first_iteration=8)
        planner = Planner(config)
        rng = np.random.default_rng(1)
        for _ in range(30):
            planner.push(rng.zipf(1.3, size=(12, 3)) % 5000)
        planner.finish()
        kernels = [f for f in vars(engine).values() if isinstance(f, Dispatcher)]
        print(len(kernels), sum(sum(f.stats.cache_misses.values()) for f in kernels))
        """,
        tmp_path,
    )
    kernels, compiled = map(int, out.split())
    assert kernels > 10 and compiled == 0
