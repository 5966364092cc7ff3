from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime import connection_limits, parse_cpus, trainer_cpus
from common.spec import parse_spec
from common.transport import ConnectionLimits

ROOT = Path(__file__).resolve().parents[2]


def test_file_limit_is_raised_to_the_hard_limit() -> None:
    # In a child whose soft limit starts low (`ulimit -Sn 256`), as on many machines.
    script = (
        "import resource\n"
        "from common.runtime import raise_file_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "assert raise_file_limit() == hard\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60)


_FAULTS_OF_MEGABYTE_BUFFERS = (
    "import resource, sys\n"
    "import numpy as np\n"
    "from common.runtime import tune_malloc\n"
    "if sys.argv[1] == 'tuned':\n"
    "    assert tune_malloc()\n"
    "def answers():  # four 1 MiB buffers alive at once, then freed: a shard's answers in flight\n"
    "    return [np.ones(1 << 18, np.float32) for _ in range(4)]\n"
    "answers()  # the heap grows once\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "for _ in range(100):\n"
    "    answers()\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_tuned_malloc_reuses_large_blocks_instead_of_faulting_in_fresh_pages() -> None:
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS_OF_MEGABYTE_BUFFERS, mode], cwd=ROOT,
                             check=True, timeout=60, capture_output=True, text=True).stdout
        return int(out)

    # By default glibc raises its mmap threshold to 1 MiB after the first free, and then trims
    # the top of its heap once more than twice that is free: the pages of every round's
    # buffers are handed back and faulted in again (256 faults a MiB).
    assert faults("default") > 100 * 500
    assert faults("tuned") < 1_000


def test_connection_limits_come_from_the_spec() -> None:
    spec = parse_spec({"cluster": {"idle_timeout_s": 5, "max_connections": 9,
                                   "max_concurrent_streams": 7, "max_resets": 50,
                                   "reset_window_s": 2.5, "unauthenticated_rate": 30,
                                   "unauthenticated_burst": 4}}, Path("/tmp/specs/x.toml"))
    assert connection_limits(spec.cluster) == ConnectionLimits(
        idle_timeout_s=5.0, max_connections=9, max_concurrent_streams=7, max_resets=50,
        reset_window_s=2.5, unauthenticated_rate=30.0, unauthenticated_burst=4,
    )
    assert connection_limits(parse_spec({}, Path("/tmp/specs/x.toml")).cluster) == ConnectionLimits()


@pytest.mark.parametrize(("cores", "trainers", "threads", "shares"), [
    (2, 2, 1, [(0,), (1,)]),
    (8, 3, 2, [(0, 1, 2), (3, 4, 5), (6, 7)]),  # sizes differ by one at most
    (16, 2, 4, [tuple(range(8)), tuple(range(8, 16))]),
    (3, 2, 2, [None, None]),  # not `threads` cores each: the OS decides
])
def test_trainers_get_contiguous_shares_of_the_cores(cores, trainers, threads, shares) -> None:
    available = [10 + c for c in range(cores)][::-1]  # any order, any numbering
    expected = [None if s is None else tuple(10 + c for c in s) for s in shares]
    assert [trainer_cpus(available, trainers, threads, r) for r in range(trainers)] == expected


def test_core_lists_parse_and_name_what_is_wrong() -> None:
    assert parse_cpus("0,3,12") == (0, 3, 12)
    with pytest.raises(ValueError, match="'x' is not a core number"):
        parse_cpus("1,x")


def test_pinning_holds_every_thread_and_the_threads_started_after() -> None:
    # In a child: the affinity of this test process must not change.
    script = (
        "import os, threading\n"
        "from common.runtime import pin_process\n"
        "core = min(os.sched_getaffinity(0))\n"
        "stop = threading.Event()\n"
        "before = threading.Thread(target=stop.wait); before.start()\n"
        "pin_process([core])\n"
        "after = threading.Thread(target=stop.wait); after.start()\n"
        "tasks = [int(t) for t in os.listdir('/proc/self/task')]\n"
        "assert len(tasks) >= 3 and all(os.sched_getaffinity(t) == {core} for t in tasks), tasks\n"
        "stop.set()\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60)
