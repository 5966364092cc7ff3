"""The repository stands on its own: no tracked file refers to a path outside it, and the
real data samples it ships are where `common.data.samples` says, which is also where the
demo's spec finds them.

A reference reaches outside when a relative path climbs above the repository root (from the
file's folder and from the root, where commands run), when a path built from ``__file__``
in Python does (``Path(__file__).resolve().parents[3] / ".."``), or when a file names the
folder the checkout sits in (a sibling folder such as ``data/`` beside a clone).
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from common.data.samples import AVAZU, CRITEO_KAGGLE, CRITEO_TERABYTE, SAMPLES
from common.job import build_job
from common.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
# A relative path of one or more `..` steps, in any text: `../x`, `../../elsewhere/data`.
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]*)")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sorted(name for name in out.decode().split("\0") if name and (ROOT / name).is_file())


def text_of(name: str) -> str | None:
    """A tracked file's text; None for a binary one (a NUL in its first 8 kB, as git decides)."""
    data = (ROOT / name).read_bytes()
    return None if b"\0" in data[:8192] else data.decode(errors="replace")


def outside(path: PurePosixPath) -> bool:
    """Whether a path relative to the repository root leaves it (`..` past the top)."""
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return True
    return False


def climbing_paths(name: str, text: str) -> Iterator[str]:
    """Relative paths in `text` that climb above the root from the file's folder and from the
    root itself (a spec names its data relative to its own folder; a command runs at the root)."""
    folder = PurePosixPath(name).parent
    for match in CLIMB.finditer(text):
        path = PurePosixPath(match.group(1))
        if outside(folder / path) and outside(path):
            yield match.group(1)


def python_paths(name: str, text: str) -> Iterator[str]:
    """Paths built from ``__file__`` (``.parent``, ``.parents[k]``, ``/ "part"``) that climb
    above the repository root, each shown as the code spells it (the whole expression once)."""
    seen: set[int] = set()
    for node in ast.walk(ast.parse(text)):  # outer expressions before the ones inside them
        if id(node) in seen:
            continue
        parts = _path_parts(node, PurePosixPath(name))
        if parts is not None and outside(PurePosixPath(*parts)):
            seen.update(id(inner) for inner in ast.walk(node))
            yield ast.unparse(node)


def _path_parts(node: ast.AST, file: PurePosixPath) -> list[str] | None:
    """The steps from the root to where the path `node` leads (``..`` for each step up), or
    None where `node` is not a path built from ``__file__``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute"):
        return _path_parts(node.func.value, file)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path" and node.args:
        arg = node.args[0]
        return list(file.parts) if isinstance(arg, ast.Name) and arg.id == "__file__" else None
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _path_parts(node.value, file)
        return None if inner is None else [*inner, ".."]
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
        inner = _path_parts(node.value.value, file)
        return None if inner is None else [*inner, *[".."] * (node.slice.value + 1)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        inner = _path_parts(node.left, file)
        part = node.right
        if inner is None or not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
            return inner
        return [*inner, *PurePosixPath(part.value).parts]
    return None


def sibling(name: str) -> bool:
    """`name` is a file or folder beside the checkout (not the checkout itself)."""
    return name != ROOT.name and (ROOT.parent / name).exists()


def references_outside(name: str, text: str) -> list[str]:
    """Every way `text` (the tracked file `name`) refers to a path outside the repository."""
    found = list(climbing_paths(name, text))
    # A sibling of the checkout by its absolute name (`<parent>/data/...`). Only siblings that
    # exist count: a made-up path in a test (`/tmp/specs/x.toml`) is not one, even in a
    # checkout that happens to sit in /tmp.
    if ROOT.parent != Path("/"):
        around = re.compile(re.escape(f"{ROOT.parent}/") + r"([^/\s\"'`)]+)")
        found += [line.strip() for line in text.splitlines()
                  if any(sibling(m.group(1)) for m in around.finditer(line))]
    if name.endswith(".py"):
        found += list(python_paths(name, text))
    return found


# --- the checks on this checkout ----------------------------------------------------------


def test_no_tracked_file_refers_outside_the_repository() -> None:
    offenders = {}
    for name in tracked_files():
        text = text_of(name)
        if text is not None and (found := references_outside(name, text)):
            offenders[name] = found
    assert not offenders, f"tracked files refer to paths outside the repository: {offenders}"


def test_the_samples_are_tracked_where_the_code_names_them() -> None:
    assert SAMPLES == ROOT / "samples"
    tracked = set(tracked_files())
    for sample in (CRITEO_KAGGLE, CRITEO_TERABYTE, AVAZU, SAMPLES / "README.md"):
        assert str(sample.relative_to(ROOT)) in tracked, sample


def test_the_demo_reads_the_shipped_criteo_sample() -> None:
    job = build_job(load_spec(ROOT / "examples" / "local.toml"))
    assert job.data.path == str(CRITEO_KAGGLE)


# --- the detector itself ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "text"), [
    ("README.md", "python -m common.data stats --path ../elsewhere/data/x.tsv"),
    ("examples/a.toml", 'path = "../../elsewhere/data/x.tsv"'),
    ("tests/x/conftest.py", 'D = Path(__file__).resolve().parents[2] / ".." / "elsewhere"'),
    ("tests/x/conftest.py", 'D = Path(__file__).resolve().parents[3] / "elsewhere"'),
    ("bench/x.py", 'D = Path(__file__).resolve().parent.parent.parent / "elsewhere"'),
    ("bench/x.py", 'D = Path(__file__).parents[0] / "../../x"'),
])
def test_references_outside_are_found(name: str, text: str) -> None:
    assert references_outside(name, text)


@pytest.mark.parametrize(("name", "text"), [
    ("examples/a.toml", 'path = "../samples/x.tsv"'),
    ("tests/x/conftest.py", 'ROOT = Path(__file__).resolve().parents[2]'),
    ("tests/x/conftest.py", 'D = Path(__file__).resolve().parents[2] / "samples" / ".." / "bench"'),
    ("bench/x.py", 'sys.path.insert(0, str(Path(__file__).resolve().parent.parent))'),
    ("docs/x.md", "see ../README.md and `a/../b`"),
])
def test_references_inside_are_not(name: str, text: str) -> None:
    assert not references_outside(name, text)


def test_a_file_naming_the_folder_around_the_checkout_refers_outside() -> None:
    if ROOT.parent == Path("/"):
        pytest.skip("the checkout is at the file system's root: nothing is around it")
    other = next((p.name for p in ROOT.parent.iterdir() if p.name != ROOT.name), None)
    if other is None:
        pytest.skip("nothing is beside the checkout")
    assert references_outside("notes.txt", f"logs in {ROOT.parent}/{other}/runs")
    assert not references_outside("notes.txt", f"logs in {ROOT.parent}/no-such-{ROOT.name}-sibling/runs")
