"""Every benchmark script runs from the repository root with `--smoke` and otherwise its
defaults, exits 0 and writes its results: the code path of a real run, at a size of seconds.

Each run writes its results (`--json`) and, where the script takes `--out`, its specs and
records under the test's own folder, named relative to the root as the default `--out` is,
so that a path resolved twice would show. A script that needs what this machine lacks (root
and network namespaces, TorchRec, GNU time) is skipped, saying which.

A script runs in the test's process, as `python bench/NAME.py ...` would run it (`__main__`,
its argv, the root as the working directory and its folder first on `sys.path`), not in a
new interpreter: a new one would spend 3 CPU-seconds importing torch and its launcher
seconds more starting zygotes that this process has warm, for every script. What a script
may change in the process (torch's threads and random state, the root logger, `sys.path`)
is put back after it; one that hangs ends the test process after `TIMEOUT_S`, with every
thread's traceback. `test_a_smoke_run_leaves_the_real_results_alone` runs one in a new
interpreter, from another folder.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import runpy
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from bench import BENCHES, RESULTS
from bench.torchrec_baseline import unavailable as torchrec_unavailable
from tests.bench.test_topology import _namespaces_unavailable

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a smoke run takes seconds; a cluster's start-up on two loaded cores, tens


def _no_gnu_time() -> str | None:
    return None if Path("/usr/bin/time").exists() else "needs GNU time at /usr/bin/time (apt-get install time)"


@dataclass(frozen=True)
class Smoke:
    """One smoke run of bench/`name`.py: its extra arguments, whether it takes `--out`, what
    it needs that a machine may lack (a reason to skip, or None), and whether it is slow."""

    name: str
    args: tuple[str, ...] = ()
    out: bool = False
    needs: Callable[[], str | None] | None = None
    slow: bool = True
    nightly: bool = False  # a variant of a script that CI's tier runs plainly

    @property
    def id(self) -> str:
        return " ".join([self.name, *self.args])

    def param(self) -> Any:
        marks = [pytest.mark.slow] if self.slow else []
        marks += [pytest.mark.nightly] if self.nightly else []
        return pytest.param(self, marks=marks, id=self.id)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # gpu_check's own default is cuda
SMOKES = (
    Smoke("e2e", out=True),
    # bench/netshape.py; CI's tier shapes links in the cluster and linkrate smokes
    Smoke("e2e", ("--shaped", "1gbit", "--no-torchrec"), out=True, needs=_namespaces_unavailable, nightly=True),
    Smoke("e2e", ("--torchrec",), out=True, needs=torchrec_unavailable),  # bench/torchrec_baseline.py
    Smoke("compute_cpu", out=True),
    Smoke("cluster", out=True, needs=_namespaces_unavailable),
    Smoke("recovery", out=True),
    Smoke("planner"),
    Smoke("ps_fetch"),
    # every fetch again over TLS, alternating with plaintext; CI's tier has the TLS fetch tests
    Smoke("ps_fetch", ("--tls",), nightly=True),
    Smoke("ps_waiting", slow=False),
    Smoke("abuse"),
    Smoke("sync_sum"),
    Smoke("scale"),
    Smoke("data", slow=False),
    Smoke("export", needs=_no_gnu_time),
    Smoke("linkrate", needs=_namespaces_unavailable),
    Smoke("gpu_check", ("--device", DEVICE)),
    # three clusters; CI's tier runs the same streams in tests/test_online.py
    Smoke("online", out=True, nightly=True),
)


def run_smoke(smoke: Smoke, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run the script as the repository root runs it; its results, read back."""
    results = tmp_path / f"{smoke.name}.json"
    argv = [f"bench/{smoke.name}.py", "--smoke", *smoke.args, "--json", str(results)]
    if smoke.out:  # relative, as the default is (runs/bench/smoke/NAME), but under tmp_path
        argv += ["--out", os.path.relpath(tmp_path / "out", ROOT)]
    code = run_script(argv)
    out, err = capfd.readouterr()
    assert code == 0, f"python {' '.join(argv)} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    return orjson.loads(results.read_bytes())


def run_script(argv: list[str]) -> int | str:
    """`python *argv` run from the repository root in this process (module docstring): the
    script's exit code, 0 if it returned."""
    with _script_process(argv), _ended_if_hung(TIMEOUT_S):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            return exit_.code or 0
    return 0


@contextlib.contextmanager
def _script_process(argv: list[str]) -> Iterator[None]:
    """This process as `python *argv` would start, from the root; what a script may change
    put back after it."""
    saved_argv, saved_path, cwd = sys.argv, list(sys.path), os.getcwd()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    os.chdir(ROOT)
    sys.argv = list(argv)
    sys.path.insert(0, str((ROOT / argv[0]).parent))
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        root.setLevel(level)
        root.handlers[:] = handlers


@contextlib.contextmanager
def _ended_if_hung(timeout_s: float) -> Iterator[None]:
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("smoke", [s.param() for s in SMOKES])
def test_a_benchmark_runs_at_smoke_size_and_writes_its_results(
    smoke: Smoke, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    if smoke.needs is not None and (reason := smoke.needs()):
        pytest.skip(reason)
    body = run_smoke(smoke, tmp_path, capfd)
    assert body["bench"].split("/")[0] == smoke.name  # a variant is e2e/shaped-1gbit, say
    assert body["smoke"] is True and body["config"]["smoke"] is True
    assert body["command"].startswith(" ".join(["python", f"bench/{smoke.name}.py", "--smoke", *smoke.args]))
    headline = body["headline"]
    assert headline["rows"] and all(len(row) == len(headline["columns"]) for row in headline["rows"])
    assert {"cpu", "cpus", "memory_gb", "python", "torch"} <= set(body["machine"])
    assert body["commit"] and body["date"].endswith("+00:00")


def test_every_benchmark_has_a_smoke_run() -> None:
    assert {s.name for s in SMOKES} == set(BENCHES)


def test_the_scripts_are_the_benchmarks_and_their_helpers() -> None:
    """A new script must join BENCHES (and get a smoke run above) or be named a helper here."""
    helpers = {"__init__", "faults", "fetch_load", "netshape", "topology", "torchrec_baseline", "render"}
    assert {p.stem for p in (ROOT / "bench").glob("*.py")} == set(BENCHES) | helpers


def test_a_smoke_run_leaves_the_real_results_alone(tmp_path: Path) -> None:
    """Without `--json`, smoke results go under the working directory's runs/bench/smoke/."""
    real = RESULTS / "ps_waiting.json"
    before = real.read_bytes() if real.exists() else None
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ps_waiting.py"), "--smoke"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    body = orjson.loads((tmp_path / "runs" / "bench" / "smoke" / "ps_waiting.json").read_bytes())
    assert body["smoke"] is True and body["cases"]
    assert (real.read_bytes() if real.exists() else None) == before
