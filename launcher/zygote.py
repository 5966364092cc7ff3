"""Roles forked from a warm template instead of started cold.

A cold ``python launch.py SPEC --role trainer`` spends about 2.5 CPU-seconds importing
torch before it does anything (the oracle about 1.3 with numba and pyarrow, a PS shard
0.8), and a local cluster starts five or more roles at every start, restart and resume. A
*zygote* is a process that has imported one role's modules (`PRELOAD`) and forks a role
per request: the role starts in milliseconds, its modules shared copy-on-write.

A forked role is what a cold start is, as far as anyone can tell:

- **the launcher's child.** The zygote forks twice and the launcher, a child subreaper
  (``PR_SET_CHILD_SUBREAPER``), adopts the grandchild: it waits for it like a child started
  by `subprocess`, sees its exit code or signal (`ForkedProcess`), and the role dies with
  the launcher (``PR_SET_PDEATHSIG``);
- **launch.py as ``__main__``** with the role's argv (also its ``/proc`` command line, so
  ``ps`` shows it), environment, working directory, a session of its own, stdin from
  /dev/null, stdout and stderr unbuffered into its log, no other descriptor open, and the
  interpreter's own exit at the end (threads joined, atexit run);
- **the same imports.** A zygote forks only for an environment equal to the one it was
  started in, apart from the variables read at run time (`RUNTIME_ENV`): whatever a module
  read at import is what a cold start would read. Any other environment gets a zygote of
  its own.

``BAGPIPE_COLD_START=1`` starts every role cold; a role that runs under a command prefix
(another network namespace) always starts cold. A zygote that cannot serve (it died, or
was never able to start) makes the launcher start that role cold and say why once.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import io
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

from common.poll import ready
from common.spec import TOKEN_ENV

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
COLD_START_ENV = "BAGPIPE_COLD_START"
#: What each kind of zygote imports before it forks: its role's modules and what they
#: import later, when they first run (DDP's constructor imports torch._dynamo and sympy;
#: opening a data set imports pyarrow). The oracle's zygote also loads the planner's
#: kernels that numba's cache holds (`_warm`).
PRELOAD: dict[str, tuple[str, ...]] = {
    "ps": ("ps.main", "common.data.dataset", "numpy.random", "pyarrow", "tqdm"),
    "oracle": ("oracle.main", "oracle.compiled", "common.data.dataset"),
    "trainer": ("trainer.main", "trainer.kernels", "common.data.dataset", "torch._dynamo", "torch.nn.parallel",
                "numpy.ma", "pyarrow", "tqdm"),
}
_EVERY_ROLE = ("encodings.idna", "faulthandler", "runpy")  # hostnames, launch.py, the runner
#: Read by the roles when they run, never at import: they may differ between the roles
#: forked from one zygote. (pytest names the test in progress in PYTEST_CURRENT_TEST,
#: which would otherwise make every test start zygotes of its own.)
RUNTIME_ENV = frozenset({TOKEN_ENV, "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"})
_READY_TIMEOUT_S = 120.0  # a zygote imports torch on a loaded machine
# The zygote's command line is padded so that a role forked from it can write its own
# command line (the launch.py argv) over it, where ps and /proc/PID/cmdline read it.
_CMDLINE_ROOM = 4096
_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 15, 36


class RoleProcess(Protocol):
    """What the launcher uses of a role's process: `subprocess.Popen` or `ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class ForkedProcess:
    """A role forked by a zygote and adopted by this process: the part of `subprocess.Popen`
    that the launcher uses, on the same waitpid statuses."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)  # our child: its pid is not reused before we reap it

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and not ready(self._pidfd, select.POLLIN, max(0.0, timeout)):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._reaped(os.waitpid(self.pid, 0)[1])
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)


@dataclass(frozen=True)
class RoleStart:
    """One role to fork: run `script` as ``__main__`` with `argv` (sys.argv[1:])."""

    script: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str
    name: str  # the process name (comm), 15 bytes at most
    launcher: int  # the pid that adopts the role

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__) + b"\n"


# -- the launcher's side -----------------------------------------------------------------------


class Zygote:
    """One zygote process of `kind`, started in environment `env`."""

    def __init__(self, kind: str, env: Mapping[str, str]) -> None:
        self.kind = kind
        self.env_key = import_env(env)
        self._lock = threading.Lock()
        self._ready = False
        boot = f"import sys; sys.path[0] = {str(REPO)!r}; from launcher.zygote import serve; serve({kind!r})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", boot, kind, " " * _CMDLINE_ROOM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(env), cwd=REPO, start_new_session=True,  # Ctrl-C in a terminal is for the launcher
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )

    def fork(self, start: RoleStart) -> ForkedProcess:
        """The role `start`, forked and adopted; raises OSError if this zygote cannot serve."""
        with self._lock:
            stdin, stdout = self.process.stdin, self.process.stdout
            assert stdin is not None and stdout is not None
            if not self._ready:
                self._expect(stdout, b"ready")
                self._ready = True
            stdin.write(start.to_json())
            stdin.flush()
            pid = int(self._expect(stdout, None))
        return ForkedProcess(pid, [sys.executable, start.script, *start.argv])

    def _expect(self, stdout: io.BufferedReader, word: bytes | None) -> bytes:
        if not ready(stdout.fileno(), select.POLLIN, _READY_TIMEOUT_S):
            raise OSError(f"the {self.kind} zygote did not answer within {_READY_TIMEOUT_S:.0f} s")
        line = stdout.readline().strip()
        if not line or (word is not None and line != word):
            code = self.process.poll()
            raise OSError(f"the {self.kind} zygote {'exited with code ' + str(code) if code is not None else 'said ' + repr(line)}")
        return line

    def end_requests(self) -> None:
        """Close its stdin: the zygote exits."""
        if self.process.stdin is not None:
            self.process.stdin.close()

    def close(self) -> None:
        self.end_requests()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Zygotes:
    """This launcher's zygotes, one per kind (and environment), started on first use and
    kept for the life of the process, so that a test session or a restarting launcher
    pays each kind's imports once."""

    def __init__(self) -> None:
        self._zygotes: dict[str, Zygote] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        atexit.register(self.close)

    def warm(self, kinds: Sequence[str], env: Mapping[str, str]) -> None:
        """Start the zygotes of `kinds` now (they import in parallel) if none fits `env`."""
        if cold_start(env):
            return
        for kind in kinds:
            self._for(kind, env)

    def start(self, kind: str, start: RoleStart) -> RoleProcess | None:
        """The role forked from a zygote of `kind`, or None: start it cold."""
        if cold_start(start.env) or kind not in PRELOAD:
            return None
        try:
            return self._for(kind, start.env).fork(start)
        except OSError as exc:
            with self._lock:
                self._zygotes.pop(kind, None)
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("starting %s cold: %s", start.name, exc)
            return None

    def _for(self, kind: str, env: Mapping[str, str]) -> Zygote:
        with self._lock:
            zygote = self._zygotes.get(kind)
            if zygote is None or zygote.env_key != import_env(env) or zygote.process.poll() is not None:
                if zygote is not None:
                    zygote.close()
                _become_subreaper()
                zygote = self._zygotes[kind] = Zygote(kind, {k: v for k, v in env.items() if k not in RUNTIME_ENV})
                log.debug("started the %s zygote (pid %d)", kind, zygote.process.pid)
            return zygote

    def close(self) -> None:
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
        for zygote in zygotes:  # all told first: they exit in parallel
            zygote.end_requests()
        for zygote in zygotes:
            zygote.close()


def start_role(start: RoleStart, *, prefix: Sequence[str] = ()) -> RoleProcess:
    """Role `start` (its kind from ``--role`` in its argv) forked from a zygote, or started
    cold where none can serve or a command `prefix` (``ip netns exec NS``) must run it: in
    either case the child of this process, in a session of its own, dying with it, its
    output appended to its log."""
    kind = start.argv[start.argv.index("--role") + 1] if "--role" in start.argv else ""
    process = None if prefix else ZYGOTES.start(kind, start)
    if process is not None:
        return process
    with open(start.log, "ab") as out:
        return subprocess.Popen(
            [*prefix, sys.executable, start.script, *start.argv], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=start.env, cwd=start.cwd, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid(), death_signal(kind)),
        )


def import_env(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """The part of an environment that imports may read."""
    return frozenset((k, v) for k, v in env.items() if k not in RUNTIME_ENV)


def cold_start(env: Mapping[str, str]) -> bool:
    return env.get(COLD_START_ENV, "") not in ("", "0")


def _become_subreaper() -> None:
    if _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def death_signal(kind: str) -> signal.Signals:
    """What a role gets when its launcher dies: SIGTERM, or the oracle SIGINT, which stops
    it at once (to a stream's oracle SIGTERM means "end at the next checkpoint", which
    trainers gone with the launcher would never reach)."""
    return signal.SIGINT if kind == "oracle" else signal.SIGTERM


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child: get `sig` when `parent` dies (Linux). If it died before the prctl, the
    signal will never come (the parent is already someone else): `sig` now."""
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


ZYGOTES = Zygotes()


# -- the zygote's side ---------------------------------------------------------------------------


def serve(kind: str) -> None:
    """The zygote's main: import `kind`'s modules, then fork a role per request line on
    stdin, answering each with the role's pid, until stdin closes; then exits at once.
    Returns (raises SystemExit) only in a role."""
    import importlib

    _set_cmdline(f"bagpipe zygote ({kind})".encode())
    for module in (*_EVERY_ROLE, *PRELOAD[kind]):
        importlib.import_module(module)
    _warm(kind)
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    answers.write(b"ready\n")
    answers.flush()
    for line in requests:
        start = RoleStart(**orjson.loads(line))
        pid = _fork_adopted(start)
        answers.write(b"%d\n" % pid)
        answers.flush()
    # Nothing to tear down: every answer is flushed and the zygote holds nothing else. An
    # interpreter's exit with torch imported takes about a second of CPU, and the launcher
    # waits for its zygotes as it exits.
    os._exit(0)


def _warm(kind: str) -> None:
    """What a role of `kind` would do first anyway and every fork can share: the oracle's
    kernels that numba's cache holds, loaded (never compiled here: a cold cache is the
    oracle's to fill, for its own mode only)."""
    if kind != "oracle":
        return
    from common.spec import MODES
    from oracle.compiled import compile_planner, is_compiled

    for mode in MODES:
        if is_compiled(mode):
            compile_planner(mode)


def _fork_adopted(start: RoleStart) -> int:
    """Fork the role through a child that exits at once, so that the launcher (a subreaper)
    adopts it; returns its pid once it is the launcher's. Runs the role in the grandchild,
    which starts once this process has reaped the middle one and closed `adopted`."""
    read_end, write_end = os.pipe()
    waiting, adopted = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        role = os.fork()
        if role == 0:
            os.close(write_end)
            os.close(adopted)
            _become(start, waiting)  # never returns
        os.write(write_end, b"%d" % role)
        os._exit(0)
    os.close(write_end)
    os.close(waiting)
    pid = int(os.read(read_end, 32))
    os.close(read_end)
    os.waitpid(middle, 0)  # the role is the launcher's child from here on
    os.close(adopted)
    return pid


def _become(start: RoleStart, waiting: int) -> None:
    """In the forked role: once adopted (`waiting` reads end-of-file), become a cold start
    of `start`, run it, exit as it exits."""
    os.read(waiting, 1)
    os.close(waiting)
    kind = start.argv[start.argv.index("--role") + 1] if "--role" in start.argv else ""
    die_with_parent(start.launcher, death_signal(kind))
    os.setsid()
    os.chdir(start.cwd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(start.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, 1 << 16)  # the zygote's pipes and whatever its imports opened
    os.environ.clear()
    os.environ.update(start.env)
    sys.stdin = open(0, closefd=False, encoding="utf-8")
    # as with PYTHONUNBUFFERED: every write reaches the log at once
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True, encoding="utf-8")
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  encoding="utf-8", errors="backslashreplace")
    sys.argv = [start.script, *start.argv]
    _set_cmdline(b"\0".join(os.fsencode(a) for a in [sys.executable, start.script, *start.argv]))
    _libc().prctl(_PR_SET_NAME, start.name.encode()[:15])
    import runpy

    runpy.run_path(start.script, run_name="__main__")
    raise SystemExit(0)


def _set_cmdline(text: bytes) -> None:
    """Write `text` (NUL-separated arguments) over this process's command line, as far as
    the room the zygote was started with allows, NUL-padded: /proc/PID/cmdline and ps show it."""
    fields = Path("/proc/self/stat").read_bytes().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    room = end - start - 1
    if room <= 0:
        return
    data = text[:room].ljust(room, b"\0")
    ctypes.memmove(start, data, room)
