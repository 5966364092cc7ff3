"""Benchmarks: each script prints its tables and writes its results to
``bench/results/<name>.json``, or where ``--json PATH`` says; ``bench/render.py`` turns the
newest results of every script into ``docs/benchmarks.md``.

A results file holds the figures (each script's own keys), its `headline` table, the
`config` it ran with, the `command`, the `machine` (CPU, cores, memory, Python, torch), the
`commit` (``-dirty`` when tracked files other than results differ from it) and the `date`
(UTC). ``--smoke`` runs a script's code path at a size of seconds, for tests; its results
go under ``runs/bench/smoke/`` and are marked `smoke`, so that they never take the place of
real ones.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SMOKE_RESULTS = Path("runs") / "bench" / "smoke"  # under the working directory, as runs/ is everywhere
# What a results file may change without making the commit it names "dirty".
GENERATED = ("bench/results", "docs/benchmarks.md")
# The scripts that measure something (the other modules are their helpers), in the order
# docs/benchmarks.md shows them.
BENCHES = (
    "e2e", "compute_cpu", "cluster", "recovery", "planner", "ps_fetch", "ps_waiting", "abuse", "sync_sum",
    "data", "export", "linkrate", "gpu_check", "scale", "online",
)  # fmt: skip


@dataclass(frozen=True)
class Table:
    """A result's headline figures as docs/benchmarks.md shows them: one row per case,
    numbers as they are (the renderer formats them)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"row {row!r} does not have the {len(self.columns)} columns {self.columns}")

    def to_json(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Table:
        return cls(tuple(body["columns"]), tuple(tuple(r) for r in body["rows"]))


def add_result_options(parser: argparse.ArgumentParser, name: str, smoke: str) -> None:
    """`--smoke` (what it shrinks: `smoke`) and `--json`, the same for every script."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"the same code path in seconds, for tests: {smoke}; results to {SMOKE_RESULTS}/, "
                             "never to bench/results/")  # fmt: skip
    parser.add_argument("--json", type=Path,
                        help=f"write the results here (default bench/results/{name}.json; "
                             f"with --smoke {SMOKE_RESULTS}/{name}.json)")  # fmt: skip


def results_path(name: str, json: Path | None, smoke: bool) -> Path:
    """Where a script's results go: `json` if given, else by `--smoke` (`add_result_options`)."""
    if json is not None:
        return json
    return SMOKE_RESULTS / f"{name}.json" if smoke else RESULTS / f"{name}.json"


def write_results(
    path: Path, *, bench: str, config: Mapping[str, Any], figures: Mapping[str, Any], headline: Table, smoke: bool,
    tables: Mapping[str, Table] | None = None,
) -> None:
    """Write a script's results to `path`: its `figures` (their keys kept at the top level),
    its `headline` table and any further `tables` (by title, shown after it), and what they
    were measured with and on."""
    reserved = {"bench", "smoke", "command", "config", "machine", "commit", "date", "headline", "tables"}
    if clash := reserved & set(figures):
        raise ValueError(f"figures may not use the keys {sorted(clash)}")
    body = {
        **figures,
        "bench": bench,
        "smoke": smoke,
        "command": command(bench.split("/")[0], sys.argv[1:]),  # a variant (e2e/fast-compute) runs its script
        "config": dict(config),
        "headline": headline.to_json(),
        "tables": {title: table.to_json() for title, table in (tables or {}).items()},
        "machine": machine(),
        "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(path, body)
    print(f"results written to {path}", file=sys.stderr)


def write_json(path: Path | None, figures: object) -> None:
    """Write `figures` to `path` as indented JSON (numpy values and paths allowed); no path, no file."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(figures, default=_plain, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {value!r}")


def config_of(args: argparse.Namespace, **settings: Any) -> dict[str, Any]:
    """A run's `config`: its arguments, then the settings they led to. A path inside the
    repository is kept relative to it: results are committed, and must not name the folder
    of the checkout that measured them."""
    return {**{k: _portable(v) for k, v in vars(args).items() if k != "json"}, **settings}


def _portable(value: Any) -> Any:
    if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(ROOT):
        return str(value.relative_to(ROOT))
    return value


def command(bench: str, argv: Sequence[str]) -> str:
    """The command that ran a script, as the repository root runs it."""
    return shlex.join(["python", f"bench/{bench}.py", *argv])


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gb": round(_meminfo_kb("MemTotal") / 2**20, 1),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
    }


def commit() -> str:
    """The checked-out commit, ``-dirty`` when a tracked file (results and the generated doc
    aside) differs from it; "unknown" outside a git checkout."""
    try:
        head = _git("rev-parse", "HEAD").strip()
        changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                       *(f":(exclude){p}" for p in GENERATED))  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if changed.strip() else head


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo_kb(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
