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

import os
import threading
from pathlib import Path

#: The name the training thread's CPU time is filed under.
TRAINING = "training"
#: How a helper process's CPU time is named: apart from the threads of the trainer's own.
HELPER_PREFIX = "process "
#: Iterations between two samples (a sample reads /proc for each thread: some 100 µs).
THREADS_EVERY = 5
_TASKS = Path("/proc/self/task")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_UNNAMED = {"python", "python3"}  # what a thread nobody named inherits from the process


def thread_cpu(training: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each thread of this process, by name;
    `training` is the native id of the thread that trains (default: the calling thread).
    Empty where /proc does not exist."""
    training = threading.get_native_id() if training is None else training
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        # Fields after the command (which may hold spaces and parentheses): utime, stime are
        # the 12th and 13th after it.
        after = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(after[11]) + int(after[12])) / _TICK
        tid = int(task.name)
        if tid == training:
            name = TRAINING
        elif tid in python_names:
            name = python_names[tid]
        else:
            name = "native" if comm in _UNNAMED else comm
        out[name] = out.get(name, 0.0) + seconds
    return out


def helper_cpu(name: str, pid: int) -> dict[str, float]:
    """CPU seconds used so far by helper process `pid` (all its threads), as
    ``{"process <name>": seconds}``; empty once it has gone or where /proc does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return {}
    after = stat[stat.rindex(")") + 2 :].split()
    return {f"{HELPER_PREFIX}{name}": (int(after[11]) + int(after[12])) / _TICK}
