"""common/ is what the roles share: it imports none of them, nor the launcher above them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "common"
ABOVE_COMMON = frozenset({"ps", "trainer", "oracle", "launcher"})


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


def test_the_walk_sees_every_kind_of_import() -> None:
    source = "import ps.store\nfrom trainer import optim\ndef f():\n    from oracle.config import X\nfrom . import y\n"
    assert imported_packages(source) == {"ps", "trainer", "oracle"}


@pytest.mark.parametrize("path", sorted(COMMON.rglob("*.py")), ids=lambda p: str(p.relative_to(COMMON)))
def test_common_imports_no_role_and_not_the_launcher(path: Path) -> None:
    assert not imported_packages(path.read_text()) & ABOVE_COMMON
