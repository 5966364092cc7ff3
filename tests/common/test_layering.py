"""Which packages may import which.

common/ is what the roles share: it imports none of them, nor the launcher above them. The
launcher is what `launch.py` runs on top of the roles: nothing but `launch.py`, the
benchmarks and the tests imports it, so serving and the roles never do (serving reads a
run's records through `trainer.records`, like the launcher).

The oracle has a client side, which the roles that join it (PS shards, trainers) import,
and a server side (the planner and numba, the directive streams, the coordinator's routes,
the data readers), which lives in oracle/ and is imported there only: a PS or a trainer
never loads it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "common"
ABOVE_COMMON = frozenset({"ps", "trainer", "oracle", "launcher"})
# Everything but launch.py, bench/ and tests/, which may import the launcher, and the launcher itself.
BELOW_LAUNCHER = ("common", "ps", "trainer", "oracle", "serving", "examples")
#: What other roles may import of the oracle: its protocol (which its servers share) and the
#: coordinator's client. Everything else in oracle/ is its server side.
ORACLE_CLIENT_SIDE = frozenset({"oracle.protocol", "oracle.coordinator_client"})
#: The oracle's servers: the directive streams and the coordinator's routes.
ORACLE_SERVERS = frozenset({"oracle.service", "oracle.coordinator_service"})


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


def imported_modules(source: str) -> set[str]:
    """Dotted names of the modules a module imports anywhere; ``from p import x`` imports
    ``p``, and ``p.x`` too where that is one of ours."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            submodules = (f"{node.module}.{alias.name}" for alias in node.names)
            modules.update(m for m in submodules if module_path(m).exists())
    return modules


def oracle_modules(path: Path) -> set[str]:
    """The oracle's modules that `path` imports."""
    return {m for m in imported_modules(path.read_text()) if m == "oracle" or m.startswith("oracle.")}


def module_path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_the_walk_sees_every_kind_of_import() -> None:
    source = "import ps.store\nfrom trainer import optim\ndef f():\n    from oracle.config import X\nfrom . import y\n"
    assert imported_packages(source) == {"ps", "trainer", "oracle"}
    assert imported_modules(source) == {"ps.store", "trainer", "trainer.optim", "oracle.config"}


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


@pytest.mark.parametrize("path", sources("ps", "trainer", "serving", "examples"), ids=lambda p: str(p.relative_to(ROOT)))
def test_other_roles_reach_the_oracle_only_through_its_client_side(path: Path) -> None:
    assert oracle_modules(path) <= ORACLE_CLIENT_SIDE


def test_the_joining_roles_share_the_oracles_client_side() -> None:
    """The coordinator's client is where a PS shard and a trainer can both use it, and both do."""
    for role in ("ps/main.py", "trainer/main.py"):
        assert "oracle.coordinator_client" in oracle_modules(ROOT / role), role


@pytest.mark.parametrize("module", sorted(ORACLE_CLIENT_SIDE | {"oracle"}))
def test_the_oracles_client_side_loads_nothing_of_its_server_side(module: str) -> None:
    """Its modules (and the package's __init__, which importing them runs) import of the
    oracle only its client side, and never numba."""
    imported = imported_modules(module_path(module).read_text())
    oracle = {m for m in imported if m.startswith("oracle.")}
    assert oracle <= ORACLE_CLIENT_SIDE and "numba" not in {m.partition(".")[0] for m in imported}


@pytest.mark.parametrize("path", [p for p in sources(*BELOW_LAUNCHER, "launcher", "bench") if "oracle" not in p.parts]
                         + [ROOT / "launch.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_oracles_servers_are_imported_in_oracle_only(path: Path) -> None:
    """The coordinator's routes and the directive streams live in oracle/ and are started by
    `oracle.main` alone (the launcher and launch.py go through it)."""
    assert not oracle_modules(path) & ORACLE_SERVERS


ROLE_ENTRY_POINTS = frozenset({"oracle.main", "ps.main", "trainer.main"})


@pytest.mark.parametrize("path", [p for p in sources(*BELOW_LAUNCHER, "launcher", "bench", "tests")
                                  if p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") not in ROLE_ENTRY_POINTS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_but_launch_py_imports_a_roles_entry_point(path: Path) -> None:
    """A role's main.py starts its process; what others build a role from (the launcher's
    in-process harness, the tests) lives in the role's own modules (`oracle.startup`,
    `ps.startup`, `trainer.startup`, ...)."""
    assert not imported_modules(path.read_text()) & ROLE_ENTRY_POINTS


def test_launch_py_starts_every_role_through_its_entry_point() -> None:
    assert imported_modules((ROOT / "launch.py").read_text()) >= ROLE_ENTRY_POINTS


@pytest.mark.parametrize("path", sources("trainer/models"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_models_know_nothing_of_the_cluster(path: Path) -> None:
    """A model (ours or a user's `[model] factory`) is a plain module: DDP and the
    collectives wrap it in the engine, so it runs the same in one process and in many."""
    imported = imported_modules(path.read_text())
    assert not {m for m in imported if m == "torch.distributed" or m.startswith("torch.distributed.")}
    assert not imported_packages(path.read_text()) & {"ps", "oracle", "launcher"}


def test_the_roles_parse_the_data_section_without_loading_the_readers() -> None:
    """Every PS shard and trainer parses `[data]` (through `common.job`); the readers, and
    pyarrow under them, load only where data is read (0.2 s of each role's start-up)."""
    code = "import sys, common.job, ps.main; print(sorted(m for m in ('pyarrow', 'common.data.convert') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_oracle_and_the_ps_start_without_torch() -> None:
    """Neither plans nor serves with torch: the oracle imports it only to write an export
    (`oracle.exporter`), so that a cold start of either skips its 2.5 CPU-seconds."""
    code = ("import sys, oracle.main, oracle.compiled, common.data.dataset, ps.main; "
            "print([m for m in ('torch',) if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
