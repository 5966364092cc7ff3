"""Which packages may import which.

common/ is what the roles share: it imports none of them, nor the launcher above them. The
launcher is what `launch.py` runs on top of the roles: nothing but `launch.py`, the
benchmarks and the tests imports it, so serving and the roles never do (serving reads a
run's records through `trainer.records`, like the launcher).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "common"
ABOVE_COMMON = frozenset({"ps", "trainer", "oracle", "launcher"})
# Everything but launch.py, bench/ and tests/, which may import the launcher, and the launcher itself.
BELOW_LAUNCHER = ("common", "ps", "trainer", "oracle", "serving", "examples")


def imported_packages(source: str) -> set[str]:
    """Top-level packages a module imports anywhere (function bodies included); relative
    imports stay within its own package and are left out."""
    packages: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            packages.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            packages.add(node.module.partition(".")[0])
    return packages


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_the_walk_sees_every_kind_of_import() -> None:
    source = "import ps.store\nfrom trainer import optim\ndef f():\n    from oracle.config import X\nfrom . import y\n"
    assert imported_packages(source) == {"ps", "trainer", "oracle"}


def test_every_top_level_package_is_placed() -> None:
    """A new top-level package must be added above, on one side of the launcher or the other."""
    packages = {p.name for p in ROOT.iterdir()
                if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))}
    assert packages == {*BELOW_LAUNCHER, "launcher", "bench", "tests"}


@pytest.mark.parametrize("path", sorted(COMMON.rglob("*.py")), ids=lambda p: str(p.relative_to(COMMON)))
def test_common_imports_no_role_and_not_the_launcher(path: Path) -> None:
    assert not imported_packages(path.read_text()) & ABOVE_COMMON


@pytest.mark.parametrize("path", sources(*BELOW_LAUNCHER), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_launch_py_the_benchmarks_and_the_tests_import_the_launcher(path: Path) -> None:
    """Serving included: it once read a run's records through `launcher.report`."""
    assert "launcher" not in imported_packages(path.read_text())


def test_the_records_need_no_torch() -> None:
    """The launcher reads a run's records without loading torch or numpy."""
    assert not imported_packages((ROOT / "trainer" / "records.py").read_text()) & {"torch", "numpy"}
