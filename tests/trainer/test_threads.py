"""A trainer's CPU time by thread (`trainer.threads`) and per sample (`launcher.summary`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from launcher.summary import HELPERS, THREAD_GROUPS, cpu_per_sample
from trainer.records import IterationRecord, ThreadsRecord, record_from_wire
from trainer.threads import TRAINING, ThreadClock, helper_cpu, thread_cpu
from trainer.timing import MACHINERY_PHASES


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_thread_is_charged_its_own_cpu_time_by_name() -> None:
    before = thread_cpu()
    worker = threading.Thread(target=_spin, args=(0.2,), name="busy-worker")
    worker.start()
    worker.join()
    _spin(0.1)
    after = thread_cpu()
    assert after[TRAINING] - before[TRAINING] >= 0.09
    # an ended thread is gone from /proc: its time is seen only while it runs
    assert "busy-worker" not in after


def test_a_running_thread_shows_under_its_python_name() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=lambda: stop.wait(5), name="waiting-worker")
    worker.start()
    try:
        assert "waiting-worker" in thread_cpu()
    finally:
        stop.set()
        worker.join()


def _iteration(x: int, samples: int, compute: float, machinery: dict[str, float] | None = None) -> IterationRecord:
    return IterationRecord(iteration=x, time=float(x), samples=samples, loss=0.5, uses=1, hits=0, fetch_rows=0,
                           fetch_bytes=0, write_back_rows=0, write_back_bytes=0, sync_rows=0, sync_bytes=0,
                           join_rows=0, compute_cpu={"forward": compute, "backward": 0.0, "dense_optimizer": 0.0},
                           machinery_cpu=machinery or {})


def test_cpu_per_sample_splits_the_training_thread_and_spans_the_widest_window() -> None:
    records = [ThreadsRecord(iteration=0, time=0.0, cpu={TRAINING: 1.0, "io": 1.0})]
    records += [_iteration(x, 100, 0.002) for x in range(10)]
    records += [ThreadsRecord(iteration=5, time=5.0, cpu={TRAINING: 1.02, "io": 1.005}),
                ThreadsRecord(iteration=10, time=10.0, cpu={TRAINING: 1.04, "io": 1.01, "gloo": 0.001})]
    figures = cpu_per_sample({0: records}, first=0, stop=10)
    assert list(figures)[:3] == list(THREAD_GROUPS)
    # 10 iterations of 100 samples: 0.04 s on the training thread, 0.02 of it in compute
    assert figures["training_thread_compute"] == pytest.approx(20.0)
    assert figures["training_thread_other"] == pytest.approx(20.0)
    assert figures["other_threads"] == pytest.approx(11.0)
    assert figures["thread io"] == pytest.approx(10.0) and figures["thread gloo"] == pytest.approx(1.0)
    assert cpu_per_sample({0: records}, first=6, stop=10) == {}  # one sample inside: no span
    assert not any(name.startswith("phase ") for name in figures)  # the records do not split it


def test_the_training_thread_outside_compute_is_split_by_phase() -> None:
    """Each machinery phase's CPU per sample, and ``phase other`` the rest of the training
    thread outside compute (records, statistics); they add up to training_thread_other."""
    machinery = {**dict.fromkeys(MACHINERY_PHASES, 0.0), "boundary": 0.001, "sync_now": 0.0005}
    records = [ThreadsRecord(iteration=0, time=0.0, cpu={TRAINING: 1.0})]
    records += [_iteration(x, 100, 0.002, machinery) for x in range(10)]
    records += [ThreadsRecord(iteration=10, time=10.0, cpu={TRAINING: 1.04})]
    figures = cpu_per_sample({0: records}, first=0, stop=10)
    assert figures["phase boundary"] == pytest.approx(10.0) and figures["phase sync_now"] == pytest.approx(5.0)
    assert figures["phase embedding_update"] == 0.0
    assert figures["phase other"] == pytest.approx(5.0)  # 20 outside compute, 15 of it in phases
    by_phase = sum(v for name, v in figures.items() if name.startswith("phase "))
    assert by_phase == pytest.approx(figures["training_thread_other"])


def test_a_helper_process_is_counted_apart_from_the_threads() -> None:
    helper = "process ps-client"
    records = [ThreadsRecord(iteration=0, time=0.0, cpu={TRAINING: 1.0, "io": 1.0, helper: 2.0})]
    records += [_iteration(x, 100, 0.002) for x in range(10)]
    records += [ThreadsRecord(iteration=10, time=10.0, cpu={TRAINING: 1.04, "io": 1.01, helper: 2.05})]
    figures = cpu_per_sample({0: records}, first=0, stop=10)
    assert figures["other_threads"] == pytest.approx(10.0)  # the io thread alone
    assert figures[HELPERS] == pytest.approx(50.0) and figures[helper] == pytest.approx(50.0)


def test_a_helper_process_is_charged_its_cpu_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while helper_cpu("spinner", child.pid).get("process spinner", 0.0) < 0.25:
            assert time.monotonic() < deadline, "the helper's CPU time never showed"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert helper_cpu("spinner", child.pid) == {}  # gone: nothing to read


def test_a_threads_record_round_trips() -> None:
    record = ThreadsRecord(iteration=5, time=1.5, cpu={TRAINING: 0.25, "gloo_tcp_loop": 0.125})
    assert record_from_wire(record.to_wire()) == record


def test_a_clock_follows_threads_that_start_and_end() -> None:
    """A kept clock reads the threads alive at each sample: a new one appears under its
    name, an ended one is dropped with its descriptor, and the caller's time only grows."""
    clock = ThreadClock()
    try:
        first = clock()
        stop = threading.Event()
        worker = threading.Thread(target=lambda: (_spin(0.05), stop.wait(5)), name="late-worker")
        worker.start()
        try:
            assert "late-worker" in clock()  # start() returns once the thread runs
        finally:
            stop.set()
            worker.join()
        _spin(0.05)
        last = clock()
        assert "late-worker" not in last and last[TRAINING] >= first[TRAINING] + 0.04
        assert len(clock._files) == len(os.listdir("/proc/self/task"))
    finally:
        clock.close()
    assert clock._files == {}
