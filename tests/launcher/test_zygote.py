"""Roles forked from a zygote (launcher/zygote.py) are what a cold start would be: the
launcher's own children, with their argv (also in /proc), environment, working directory,
log and exit status, nothing else open, dying with the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.zygote import COLD_START_ENV, RoleStart, Zygotes

ROLE = textwrap.dedent("""
    import json, os, sys
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    print(json.dumps({
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "ppid": os.getppid(), "fds": fds,
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode().split("\\0"),
        "comm": open("/proc/self/comm").read().strip(), "stdin": sys.stdin.read(),
        "env": os.environ.get("ROLE_VALUE"), "session": os.getsid(0) == os.getpid(),
    }))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "sleep":
        import time
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def zygotes() -> Iterator[Zygotes]:
    made = Zygotes()
    yield made
    made.close()


def start_of(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> RoleStart:
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    (tmp_path / "work").mkdir(exist_ok=True)
    return RoleStart(script=str(script), argv=list(argv), env={**os.environ, **(env or {})},
                     cwd=str(tmp_path / "work"), log=str(tmp_path / "role.log"), name="ps-7", launcher=os.getpid())


def test_a_forked_role_is_the_launchers_child_with_its_own_argv_env_cwd_and_log(
    tmp_path: Path, zygotes: Zygotes
) -> None:
    start = start_of(tmp_path, "3", "--role", "ps", env={"ROLE_VALUE": "seen", "BAGPIPE_TOKEN": "t"})
    process = zygotes.start("ps", start)
    assert process is not None
    assert process.wait(60) == 3
    out, err = Path(start.log).read_text().splitlines()
    seen = json.loads(out)
    assert err == "to stderr"
    assert seen["name"] == "__main__" and seen["argv"] == [start.script, "3", "--role", "ps"]
    assert seen["cmdline"] == [sys.executable, start.script, "3", "--role", "ps"]
    assert seen["comm"] == "ps-7" and seen["cwd"] == start.cwd and seen["ppid"] == os.getpid()
    assert seen["env"] == "seen" and seen["stdin"] == "" and seen["session"]
    assert seen["fds"] == [0, 1, 2, 3]  # and the one that listed them


def test_a_forked_role_is_waited_for_and_signalled_like_a_child(tmp_path: Path, zygotes: Zygotes) -> None:
    process = zygotes.start("ps", start_of(tmp_path, "sleep"))
    assert process is not None and process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == -signal.SIGTERM and process.poll() == -signal.SIGTERM
    process.kill()  # reaped: no signal goes to a pid that may be someone else's now


def test_an_environment_that_imports_may_read_gets_a_zygote_of_its_own(tmp_path: Path, zygotes: Zygotes) -> None:
    def zygote_pid(env: dict[str, str]) -> int:
        process = zygotes.start("ps", start_of(tmp_path, "0", env=env))
        assert process is not None and process.wait(60) == 0
        return zygotes._zygotes["ps"].process.pid

    first = zygote_pid({"BAGPIPE_TOKEN": "one"})
    assert zygote_pid({"BAGPIPE_TOKEN": "two", "PYTEST_CURRENT_TEST": "another"}) == first  # read at run time only
    assert zygote_pid({"BAGPIPE_TOKEN": "one", "SOMETHING_ELSE": "1"}) != first


def test_a_dead_zygote_is_replaced_and_one_that_cannot_start_means_a_cold_start(
    tmp_path: Path, zygotes: Zygotes
) -> None:
    assert zygotes.start("ps", start_of(tmp_path, "0", env={COLD_START_ENV: "1"})) is None
    first = zygotes.start("ps", start_of(tmp_path, "0"))
    assert first is not None and first.wait(60) == 0
    dead = zygotes._zygotes["ps"].process
    dead.kill()
    dead.wait()
    again = zygotes.start("ps", start_of(tmp_path, "0"))
    assert again is not None and again.wait(60) == 0 and zygotes._zygotes["ps"].process.pid != dead.pid
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tqdm.py").write_text("raise ImportError('a module the zygote imports is broken')\n")
    assert zygotes.start("ps", start_of(tmp_path, "0", env={"PYTHONPATH": str(broken)})) is None


LAUNCHER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from launcher.zygote import ZYGOTES, RoleStart
    role = ZYGOTES.start("ps", RoleStart(script=sys.argv[2], argv=["sleep"], env=dict(os.environ), cwd=os.getcwd(),
                                         log=sys.argv[3], name="ps-0", launcher=os.getpid()))
    print(role.pid, flush=True)
    import time
    time.sleep(600)
""")


def test_a_forked_role_dies_with_its_launcher(tmp_path: Path) -> None:
    script = start_of(tmp_path).script
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(Path(__file__).parents[2]), script,
                                 str(tmp_path / "role.log")], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    role = int(launcher.stdout.readline())
    assert _parent(role) == launcher.pid
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while _parent(role) is not None:
        assert time.monotonic() < deadline, "the role outlived its launcher"
        time.sleep(0.05)


def _parent(pid: int) -> int | None:
    """The parent of a live (not zombie) process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in "ZX" else int(fields[1])
