"""CPU time of every thread of this process, by name: where a trainer's own work goes.

On a GPU host the other roles have hosts of their own and a trainer has idle cores; what
cannot be hidden is the work of the training thread outside the model's compute, and the
work of other threads that contend for the GIL with it. So a trainer samples, every few
iterations, the CPU seconds each of its threads has used (Linux: ``/proc/self/task``), and
the report turns them into microseconds per sample (`launcher.summary`).

Threads are named by what Python calls them (the I/O thread, sync-later), by the name
native code gave them (``gloo_tcp_loop``, ``pt_gloo_runloop``), or ``native`` for an unnamed
native one; threads of one name are added up. The thread that trains is ``training``. A
helper process of the trainer's (`trainer.ps_process`) is filed whole under ``process <name>``,
apart from the threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

#: The name the training thread's CPU time is filed under.
TRAINING = "training"
#: How a helper process's CPU time is named: apart from the threads of the trainer's own.
HELPER_PREFIX = "process "
#: Iterations between two samples.
THREADS_EVERY = 5
_TASKS = "/proc/self/task"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_UNNAMED = {"python", "python3"}  # what a thread nobody named inherits from the process
_READ_BYTES = 256  # a schedstat line is three numbers, a comm at most 16 bytes


class ThreadClock:
    """Samples the CPU seconds each thread of this process has used, by name. It keeps
    each thread's ``schedstat`` (CPU time in nanoseconds, as `time.thread_time` counts it;
    ``stat``'s user and system times tick at 10 ms) and ``comm`` (the native name) open and
    reads them again with `os.pread`: a sample of a trainer's threads costs about a tenth of
    opening and reading files each time (which took some 1.2 ms every `THREADS_EVERY`
    iterations on two busy cores, 0.24 µs a sample of the trainer's slice). A clock
    belongs to the process that made it (after a fork its descriptors read the parent's
    threads): a forked child's clock starts afresh."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._files: dict[int, tuple[int, int]] = {}  # tid -> descriptors of schedstat, comm

    def __call__(self, training: int | None = None) -> dict[str, float]:
        """CPU seconds so far of each thread by name; `training` is the native id of the
        thread that trains (default: the calling thread). Empty where /proc does not exist."""
        training = threading.get_native_id() if training is None else training
        try:
            tids = {int(name) for name in os.listdir(_TASKS)}
        except OSError:
            return {}
        self._follow(tids)
        python_names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, float] = {}
        for tid, (schedstat, comm) in list(self._files.items()):
            try:
                seconds = int(os.pread(schedstat, _READ_BYTES, 0).split()[0]) / 1e9
                if tid == training:
                    name = TRAINING
                elif tid in python_names:
                    name = python_names[tid]
                else:
                    native = os.pread(comm, _READ_BYTES, 0).decode(errors="replace").strip()
                    name = "native" if native in _UNNAMED else native
            except OSError:  # the thread ended meanwhile
                self._forget(tid)
                continue
            out[name] = out.get(name, 0.0) + seconds
        return out

    def close(self) -> None:
        for tid in list(self._files):
            self._forget(tid)

    def _follow(self, tids: set[int]) -> None:
        """Open the files of each new thread, close those of ended ones."""
        if os.getpid() != self._pid:  # forked: the descriptors are the parent's threads'
            self._files.clear()
            self._pid = os.getpid()
        for tid in self._files.keys() - tids:
            self._forget(tid)
        for tid in tids - self._files.keys():
            opened = []
            try:
                for name in ("schedstat", "comm"):
                    opened.append(os.open(f"{_TASKS}/{tid}/{name}", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:  # ended between the listing and the open
                _close(opened)
                continue
            self._files[tid] = (opened[0], opened[1])

    def _forget(self, tid: int) -> None:
        _close(self._files.pop(tid))


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def thread_cpu(training: int | None = None) -> dict[str, float]:
    """One sample of a fresh `ThreadClock` (a loop that samples often keeps a clock)."""
    clock = ThreadClock()
    try:
        return clock(training)
    finally:
        clock.close()


def helper_cpu(name: str, pid: int) -> dict[str, float]:
    """CPU seconds used so far by helper process `pid` (all its threads), as
    ``{"process <name>": seconds}``; empty once it has gone or where /proc does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return {}
    after = stat[stat.rindex(")") + 2 :].split()
    return {f"{HELPER_PREFIX}{name}": (int(after[11]) + int(after[12])) / _TICK}
