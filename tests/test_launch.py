"""The launcher's behaviour on failure (docs/design.md#launcher-and-cluster-spec): `python launch.py` as a user runs it.

Every test starts real subprocesses on real ports: a role killed mid-run stops the whole
cluster, Ctrl-C stops it, killing the launcher itself orphans nothing, a bad spec starts
nothing, a single role serves and stops on SIGTERM, and the default command reports.
Processes are identified by (pid, start time) from /proc, so a recycled PID never passes
for a survivor; a zombie counts as dead (it holds no port and runs no code).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from common.job import build_job
from common.spec import load_spec
from oracle.startup import build_workload
from tests.cluster_helpers import write_spec

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch.py"
START_S = 120.0  # a cluster up and training, on two shared cores under other tests' load
STOP_S = 15.0  # "within seconds": the launcher's own SIGTERM grace is 10 s
TOKEN = "launch-test-token"


# --- processes, from /proc ---------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int  # clock ticks after boot: tells a recycled PID apart
    cmdline: tuple[str, ...]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of `pid`, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _proc(pid: int) -> Proc | None:
    stat = _stat(pid)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return None
    if stat is None:
        return None
    return Proc(pid, stat[1], stat[2], tuple(part.decode(errors="replace") for part in cmdline if part))


def descendants(root: int) -> list[Proc]:
    """Every live process below `root` (like `ps --ppid`, recursively)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[1]
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and (proc := _proc(pid)) is not None:
                found.append(proc)
                frontier.append(pid)
    return found


def alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat[2] == proc.start and stat[0] not in "ZX"


def reaped(proc: Proc) -> bool:
    """Gone without a trace: its parent waited for it. A role that outlived the launcher
    would be reparented to init instead, which need not reap (here PID 1 does not)."""
    stat = _stat(proc.pid)
    return stat is None or stat[2] != proc.start


def role_process(procs: list[Proc], role: str, index: int | None = None) -> Proc:
    """The process running `launch.py ... --role ROLE [--index N]` among `procs`."""
    for proc in procs:
        args = proc.cmdline
        if "--role" in args and args[args.index("--role") + 1] == role:
            if index is None or args[args.index("--index") + 1] == str(index):
                return proc
    raise AssertionError(f"no {role} {index} among {[p.cmdline for p in procs]}")


# --- waiting and ports ---------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def assert_port_free(port: int) -> None:
    """A new server can listen on `port` (with SO_REUSEADDR, as every server sets it, so that
    connections of the old one lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


# --- a running launcher ---------------------------------------------------------------------


@dataclass
class Launcher:
    """`python launch.py SPEC --quiet --run-dir RUN` as a subprocess, output in files."""

    process: subprocess.Popen
    run_dir: Path
    stdout: Path
    stderr: Path
    seen: list[Proc] = field(default_factory=list)  # its process tree, for the clean-up

    def iterations(self, trainer: int) -> int:
        """Iteration records in the trainer's records file so far."""
        try:
            return (self.run_dir / f"trainer-{trainer}.jsonl").read_bytes().count(b'{"kind":"iter"')
        except FileNotFoundError:
            return 0

    def wait_training(self, trainers: int = 2, iterations: int = 20) -> list[Proc]:
        """Block until every trainer has recorded `iterations`; the launcher's process tree."""

        def progressing() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"launcher exited early ({self.process.returncode}):\n{self.err()}")
            return all(self.iterations(j) >= iterations for j in range(trainers))

        wait_for(progressing, START_S, f"{iterations} iterations of every trainer")
        self.seen = descendants(self.process.pid)
        return self.seen

    def wait_exit(self, timeout_s: float = STOP_S) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running {timeout_s:.0f} s later:\n{self.err()}") from None

    def ports(self) -> list[int]:
        """Every port the PS shards and the oracle listen on, from their ready files."""
        ports = []
        for ready in sorted(self.run_dir.glob(".*.ready")):
            info = json.loads(ready.read_text())
            ports += [info["port"]] + ([info["http1_port"]] if "http1_port" in info else [])
        return ports

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Callable[[], Launcher]]:
    """Starts `launch.py` on a spec that trains for minutes (6,100 iterations): every test
    ends it long before; whatever a failing test leaves is killed here."""
    started: list[Launcher] = []

    def start() -> Launcher:
        spec = write_spec(tmp_path, "long", {"train": {"epochs": 100, "max_iterations": 0}})
        run_dir = tmp_path / "run"
        out, err = tmp_path / "launch.out", tmp_path / "launch.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, str(LAUNCH), str(spec), "--quiet", "--run-dir", str(run_dir)],
                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=tmp_path,
                # Ctrl-C must reach the launcher even when pytest runs where SIGINT is ignored
                # (a background job of a non-interactive shell): a child inherits SIG_IGN.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        started.append(Launcher(process, run_dir, out, err))
        return started[-1]

    yield start
    for item in started:
        leftovers = item.seen + descendants(item.process.pid)
        if item.process.poll() is None:
            item.process.kill()
            item.process.wait()
        for proc in leftovers:
            if alive(proc):
                os.kill(proc.pid, signal.SIGKILL)


def assert_all_gone(procs: list[Proc], timeout_s: float = STOP_S) -> None:
    assert procs, "no role processes were seen"
    wait_for(lambda: not any(alive(p) for p in procs), timeout_s,
             "the run's processes to exit: " + ", ".join(str(p.pid) for p in procs if alive(p)))


def assert_stopped_by(launcher: subprocess.Popen, procs: list[Proc]) -> None:
    """The launcher stopped and waited for every role before it exited itself (rather than
    leaving them to PR_SET_PDEATHSIG), then nothing of the run is left."""
    roles = [p for p in procs if p.ppid == launcher.pid and "--role" in p.cmdline]  # not its zygotes
    assert len(roles) == 5, roles  # 2 PS, the oracle, 2 trainers
    assert all(reaped(p) for p in roles), [p.cmdline for p in roles if not reaped(p)]
    assert_all_gone(procs)


# --- the tests ------------------------------------------------------------------------------


def test_help_explains_roles_spec_and_resume() -> None:
    done = subprocess.run([sys.executable, str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    needles = ("SPEC.toml", "--role ps", "--role oracle", "--role trainer", "--index", "--resume", "checkpoint")
    for needle in needles:
        assert needle in text, f"--help does not mention {needle!r}:\n{text}"


@pytest.mark.slow
def test_a_killed_trainer_stops_every_role(launcher: Callable[[], Launcher]) -> None:
    run = launcher()
    procs = run.wait_training()
    ports = run.ports()
    assert len(ports) == 6, ports  # (2 PS + the oracle) x (h2 + HTTP/1.1)
    victim = role_process(procs, "trainer", 1)
    marker = "test_launch: the last line trainer-1 logged before kill -9"
    with open(run.run_dir / "logs" / "trainer-1.log", "a") as log:  # O_APPEND, like the role
        log.write(marker + "\n")

    os.kill(victim.pid, signal.SIGKILL)
    code = run.wait_exit()

    err = run.err()
    assert code == 1, err
    headline = "bagpipe: trainer-1 was killed by SIGKILL"
    assert headline in err, err
    message = err[err.index(headline) :]
    assert marker in message, err  # its last log lines are shown, last of all
    assert "launcher.progress" not in message, err
    assert_stopped_by(run.process, procs)
    for port in ports:
        assert_port_free(port)


@pytest.mark.slow
def test_ctrl_c_stops_every_role(launcher: Callable[[], Launcher]) -> None:
    run = launcher()
    procs = run.wait_training()

    run.process.send_signal(signal.SIGINT)
    code = run.wait_exit()

    assert code == 130, run.err()
    assert "interrupted; all roles stopped" in run.err()
    assert_stopped_by(run.process, procs)
    for port in run.ports():
        assert_port_free(port)


@pytest.mark.slow
def test_killing_the_launcher_orphans_nothing(launcher: Callable[[], Launcher]) -> None:
    run = launcher()
    procs = run.wait_training()

    run.process.kill()
    run.process.wait()

    assert_all_gone(procs)  # PR_SET_PDEATHSIG: each role got SIGTERM when the launcher died
    for port in run.ports():
        assert_port_free(port)


@pytest.mark.parametrize(
    "role", [[], ["--role", "ps", "--index", "0"], ["--role", "trainer", "--index", "0"]], ids=["cluster", "ps", "trainer"]
)
def test_a_bad_spec_is_refused_before_any_role_starts(tmp_path: Path, role: list[str]) -> None:
    spec = write_spec(tmp_path, "bad", {"oracle": {"lookahed": 3}})
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(LAUNCH), str(spec), "--quiet", "--run-dir", str(run_dir), *role],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "oracle.lookahed" in done.stderr and "unknown field" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (run_dir / "logs").exists(), "roles were started"
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("role", [[], ["--role", "trainer", "--index", "0"]], ids=["cluster", "trainer"])
def test_a_bad_model_factory_is_refused_before_any_role_starts(tmp_path: Path, role: list[str]) -> None:
    model = {"factory": "tests.trainer.test_factory:column_logits", "embedding_dim": 8}
    spec = write_spec(tmp_path, "bad-model", {"cluster": {"token": "t"}}, model=model)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(LAUNCH), str(spec), "--quiet", "--run-dir", str(run_dir), *role],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "model.factory: forward(dense (2, 4), emb (2, 4, 8)) returned" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (run_dir / "logs").exists(), "roles were started"


def _distinct_rows_needed(spec: Path) -> int:
    """The most distinct rows one trainer uses in one iteration of `spec`'s run."""
    job = build_job(load_spec(spec))
    per = job.spec.train.batch_size // job.spec.trainers.count
    return max(
        np.unique(keys[j * per : (j + 1) * per]).size
        for keys, _, _ in build_workload(job).key_batches()
        for j in range(job.spec.trainers.count)
    )


@pytest.mark.parametrize("mode", ["bagpipe", "static-cache"])
def test_a_cache_too_small_is_refused_before_any_role_starts(tmp_path: Path, mode: str) -> None:
    cache_rows = 10 if mode == "bagpipe" else 64  # 64 = (B/T) x F: no room left for a hot row
    spec = write_spec(tmp_path, "small", {"oracle": {"mode": mode, "cache_rows": cache_rows}})
    need = _distinct_rows_needed(spec) if mode == "bagpipe" else 65
    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "dense.pt").write_bytes(b"the previous run's model")
    done = subprocess.run(
        [sys.executable, str(LAUNCH), str(spec), "--quiet", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert f"oracle.cache_rows: C = {cache_rows} " in done.stderr, done.stderr
    assert f"needs C >= {need}" in done.stderr, done.stderr
    assert not (run_dir / "logs").exists(), "roles were started"
    assert (run_dir / "final" / "dense.pt").exists(), "the previous run's outputs were removed"


@pytest.mark.slow
@pytest.mark.parametrize("role", ["oracle", "ps"])
def test_a_role_whose_port_is_taken_says_so_in_one_line(tmp_path: Path, role: str) -> None:
    """A second oracle on a port in use exited with a 30-line traceback (EADDRINUSE)."""
    spec = write_spec(tmp_path, "taken", {})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        flags = (["--oracle-address", address] if role == "oracle"
                 else ["--index", "0", "--ps-addresses", f"{address},127.0.0.1:0"])
        done = subprocess.run(
            [sys.executable, str(LAUNCH), str(spec), "--role", role, *flags, "--admin-port", "0"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "BAGPIPE_TOKEN": TOKEN},
        )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"launch.py: cannot listen on {address}: ") and "another process" in last, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_one_ps_role_serves_health_writes_its_stacks_on_sigusr1_and_stops_on_sigterm(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    spec = write_spec(tmp_path, "solo", {})
    ready = tmp_path / "ps-0.ready"
    process = subprocess.Popen(
        [sys.executable, str(LAUNCH), str(spec), "--role", "ps", "--index", "0", "--ready-file", str(ready)],
        env={**os.environ, "BAGPIPE_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, cwd=tmp_path,
    )
    try:
        wait_for(lambda: ready.exists() or process.poll() is not None, 60, "the PS ready file")
        assert process.poll() is None, process.communicate()[0].decode()
        port = json.loads(ready.read_text())["port"]

        def curl(*args: str) -> tuple[int, str]:
            done = subprocess.run(
                ["curl", "-sS", "--http2-prior-knowledge", "--max-time", "20", "-w", "\n%{http_code}", *args],
                capture_output=True, text=True, timeout=30,
            )
            assert done.returncode == 0, done.stderr
            body, _, status = done.stdout.rpartition("\n")
            return int(status), body

        status, body = curl(f"http://127.0.0.1:{port}/v1/health")
        assert status == 200, body
        assert json.loads(body) == {"role": "ps", "ok": True}, body
        # The token from $BAGPIPE_TOKEN guards the data routes and the shard's status: refused
        # without it, accepted with it (an empty fetch is then a bad request, not an
        # unauthorised one).
        assert curl("-X", "POST", f"http://127.0.0.1:{port}/v1/fetch")[0] == 401
        assert curl(f"http://127.0.0.1:{port}/v1/status")[0] == 401
        bearer = f"Authorization: Bearer {TOKEN}"
        status, body = curl("-H", bearer, f"http://127.0.0.1:{port}/v1/status")
        shard = json.loads(body)
        assert status == 200 and shard["shard"] == 0 and shard["num_shards"] == 2, body
        authorised = curl("-X", "POST", "-H", bearer, f"http://127.0.0.1:{port}/v1/fetch")
        assert authorised[0] == 400, authorised
        # SIGUSR1 writes every thread's stack into the log (where a stuck role waits); it
        # goes on serving
        process.send_signal(signal.SIGUSR1)
        assert curl(f"http://127.0.0.1:{port}/v1/health")[0] == 200

        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=STOP_S)[0].decode(errors="replace")
        assert process.returncode == 0, output
        assert "stop signal received" in output, output
        assert "Current thread" in output and "most recent call first" in output, output
        assert_port_free(port)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
def test_the_default_command_reports(tmp_path: Path) -> None:
    """About 17 s: the shipped 8,000-row Criteo sample, one epoch."""
    run_dir = tmp_path / "run"
    spec = ROOT / "examples" / "local.toml"
    done = subprocess.run(
        [sys.executable, str(LAUNCH), str(spec), "--quiet", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,  # checkpoints go to ./runs/
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert "eval AUC" in done.stdout, done.stdout
    assert "Memory (RSS in MB" in done.stdout, done.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report, "empty report"
    roles = {"oracle", "ps-0", "ps-1", "trainer-0", "trainer-1"}
    assert {f["role"] for f in report["extra"]["rss"]} == roles  # every role sampled at least once
    for png in ("throughput.png", "breakdown.png", "loss.png", "memory.png"):
        assert (run_dir / png).read_bytes().startswith(b"\x89PNG"), png
