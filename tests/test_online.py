"""Online training on real clusters (docs/design.md#online-training): a writer process lands
the parts of a Criteo stream in a watched folder at random times while the run trains; the
run ends bit-identical to the data-parallel reference of the offline run over the same parts
in the same order, in every mode, with its plan cut where the trainers caught up with the
data. Killing a role with kill -9 mid-stream and restarting it as any run does loses and
repeats nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from common.checkpoints import final_paths, latest_complete
from common.job import OPEN_END, Job, build_job
from common.spec import TOKEN_ENV, load_spec
from launcher.cluster import LocalCluster, Restart, run_cluster
from serving.chain import ExportChain
from serving.export import export_model
from serving.predict import load_export
from serving.sources import open_checkpoint
from tests.cluster_helpers import TOKEN, as_final, assert_identical, final_model, reference_for, write_spec
from tests.launcher.test_scrape import METRICS_DOC, Scraper
from tests.test_recovery import KillAt
from trainer.records import IterationRecord, RunTail

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "criteo_kaggle_head8000.tsv"
CUTS = (0, 700, 1000, 1650, 1680, 2400, 3300)  # six parts, one of 30 rows
ITERATIONS, BATCH = 100, 32  # the stream holds 103 batches


BAD_LINE = "1\tnot a row\n"  # in part 3, at its line 2: quarantined, never trained


def split_sample(folder: Path, *, bad_line: bool = True) -> list[Path]:
    """The sample's first rows as parts of uneven sizes, in natural order; part 3 holds a
    malformed line unless not `bad_line`."""
    folder.mkdir()
    lines = SAMPLE.read_text().splitlines(keepends=True)
    parts = []
    for k, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        parts.append(folder / f"part-{k}.tsv")
        rows = lines[a:b]
        parts[-1].write_text("".join(rows[:1] + [BAD_LINE] + rows[1:] if k == 3 and bad_line else rows))
    return parts


def data_section(path: str | list[str], *, watch: bool) -> dict[str, object]:
    section: dict[str, object] = {"format": "criteo", "path": path, "table_sizes": [97] * 26}
    return section | ({"watch": True, "poll_s": 0.1} if watch else {"on_error": "skip"})


def overrides(mode: str, iterations: int = ITERATIONS, **extra: dict[str, object]) -> dict[str, dict[str, object]]:
    """The test job's sections in `mode`, with `extra` sections (or sections replaced)."""
    return {"oracle": {"mode": mode, "cache_rows": 450},
            "train": {"batch_size": BATCH, "max_iterations": iterations}, **extra}


def offline_reference(tmp_path: Path, parts: list[Path], mode: str, iterations: int = ITERATIONS) -> Job:
    """The job of the offline run over `parts`, in their order, for as many iterations."""
    spec = write_spec(tmp_path, f"offline-{mode}", overrides(mode, iterations),
                      data=data_section([str(p) for p in parts], watch=False))
    return build_job(load_spec(spec))


def start_writer(incoming: Path, parts: list[Path], seed: int, run_dir: Path, *,
                 push_to: str | None = None) -> subprocess.Popen:
    """The writer: the first part at once, the others while the trainers train; with
    `push_to` (the oracle's address) every second part pushed to it instead."""
    started = run_dir / "trainer-0.jsonl"
    push = ["--push", push_to] if push_to else []
    return subprocess.Popen([sys.executable, "-m", "tests.stream_writer", str(incoming), str(seed), str(started),
                             str(BATCH), *push, *map(str, parts)], cwd=ROOT, env={**os.environ, TOKEN_ENV: TOKEN})


def taken_order(job: Job, parts: list[Path]) -> list[Path]:
    """The parts in the order the stream took them (a pushed part by its content)."""
    logged = [Path(orjson.loads(line)["path"]) for line in
              (job.spec.checkpoint.dir / "stream" / "parts.jsonl").read_bytes().splitlines()]
    by_content = {p.read_bytes(): p for p in parts}
    return [by_content[p.read_bytes()] for p in logged]


def segment_ends(job: Job) -> list[int]:
    lines = (job.spec.checkpoint.dir / "stream" / "segments.jsonl").read_bytes().splitlines()
    return [orjson.loads(line)["end"] for line in lines if b"end" in line]


# CI runs bagpipe (every kind of directive) on a real cluster; every mode's cut plans run in
# process there (tests/trainer/test_online.py), and here nightly.
MODES = [pytest.param(m, marks=[] if m == "bagpipe" else [pytest.mark.nightly])
         for m in ("bagpipe", "no-cache", "static-cache", "local")]


@pytest.mark.parametrize("mode", MODES)
def test_an_online_run_is_bit_identical_to_offline(tmp_path: Path, mode: str) -> None:
    parts = split_sample(tmp_path / "parts")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    spec = write_spec(tmp_path, f"online-{mode}", overrides(mode), data=data_section(str(incoming / "*.tsv"), watch=True))
    job = build_job(load_spec(spec))
    writer = start_writer(incoming, parts, len(mode), tmp_path / "run")
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN)
    finally:
        writer.wait(30)
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(offline_reference(tmp_path, parts, mode))))
    # the trainers caught up with the stream, so the plan was cut, and trained through
    ends = segment_ends(job)
    assert ends and all(0 < e < ITERATIONS for e in ends), ends
    summary = orjson.loads((job.spec.checkpoint.dir / "stream" / "summary.json").read_bytes())
    assert (summary["parts"], summary["rows"], summary["bad_rows"], summary["cuts"]) == (6, 3300, 1, len(ends))
    (kept,) = (job.spec.checkpoint.dir / "stream" / "quarantine.jsonl").read_bytes().splitlines()
    assert orjson.loads(kept) | {"why": ""} == {"part": str(incoming / "part-3.tsv"), "line": 2, "why": "",
                                                "text": BAD_LINE.rstrip("\n")}


class WriterOnceServing:
    """on_poll hook: start the writer once the oracle serves (it pushes to it)."""

    def __init__(self, start: Callable[[str], subprocess.Popen]) -> None:
        self.start, self.writer = start, None

    def __call__(self, cluster: LocalCluster) -> None:
        if self.writer is None and cluster.oracle_address is not None:
            self.writer = self.start(str(cluster.oracle_address))


def test_rows_pushed_and_landed_train_bit_identical_to_offline_in_the_order_taken(tmp_path: Path) -> None:
    """A body with a bad line is refused whole (tests/common/data/test_spool.py): these parts
    are all good."""
    parts = split_sample(tmp_path / "parts", bad_line=False)
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    lingering = overrides("bagpipe", cluster={"metrics_linger_s": 60})  # the oracle's last page is scraped
    spec = write_spec(tmp_path, "pushed", lingering, data=data_section(str(incoming / "*.tsv"), watch=True))
    job = build_job(load_spec(spec))
    hook = WriterOnceServing(lambda oracle: start_writer(incoming, parts, 9, tmp_path / "run", push_to=oracle))
    scraper = Scraper(tmp_path / "run")
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN, on_poll=lambda c: (hook(c), scraper(c)))
    finally:
        if hook.writer is not None:
            assert hook.writer.wait(30) == 0
    order = taken_order(job, parts)
    assert sorted(order) == parts and len(list((job.spec.checkpoint.dir / "stream" / "spool").iterdir())) == 3
    oracle = scraper.last["oracle"]
    pushed = sum(p.read_bytes().count(b"\n") for p in parts[1::2])
    assert (oracle.value("bagpipe_stream_rows_pushed_total"), oracle.value("bagpipe_stream_parts_taken_total"),
            oracle.value("bagpipe_stream_rows_taken_total")) == (pushed, 6, 3300)
    documented = METRICS_DOC.read_text()
    assert [f for f in oracle.kinds if f.startswith("bagpipe_stream_") and f"`{f}`" not in documented] == []
    offline = offline_reference(tmp_path, order, "bagpipe")
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(offline)))


KILLS = [pytest.param(role, marks=[] if role == "oracle" else [pytest.mark.nightly])
         for role in ("oracle", "trainer-1", "ps-0")]


@pytest.mark.parametrize("role", KILLS)
def test_kill_a_role_during_online_training_and_recover_bit_identically(tmp_path: Path, role: str) -> None:
    """The oracle comes back alone and replays its cuts (the trainers keep their caches);
    a trainer's death restarts every role from the latest checkpoint, the stream read again
    in the order it was taken."""
    parts = split_sample(tmp_path / "parts")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    extra = {"checkpoint": {"every": 5, "restart": True}}
    spec = write_spec(tmp_path, "killed", overrides("bagpipe", checkpoint=extra["checkpoint"]), data=data_section(str(incoming / "*.tsv"),
                                                                                          watch=True))
    job = build_job(load_spec(spec))
    kill = KillAt(tmp_path / "run", role, random.Random(role).randrange(10, 40))
    writer = start_writer(incoming, parts, 3, tmp_path / "run")
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN, on_poll=kill)
    finally:
        writer.wait(30)
    assert kill.killed_pid is not None, "the run ended before the kill point"
    assert result.restarts == (Restart(role, alone=role != "trainer-1"),)
    want = as_final(reference_for(offline_reference(tmp_path, parts, "bagpipe")))
    assert_identical(final_model(job, result.run_dir), want)


class StopAt:
    """on_poll hook: stop the stream once every trainer has finished iteration `iteration`:
    SIGTERM to the oracle, or ``launch.py stop``."""

    def __init__(self, run_dir: Path, iteration: int, how: str) -> None:
        self.tail = RunTail(run_dir, 2)
        self.iteration, self.how = iteration, how
        self.done: dict[int, int] = {}
        self.sent = False

    def __call__(self, cluster: LocalCluster) -> None:
        for trainer, records in self.tail.poll().items():
            for r in records:
                if isinstance(r, IterationRecord):
                    self.done[trainer] = max(self.done.get(trainer, -1), r.iteration)
        if not self.sent and len(self.done) == 2 and min(self.done.values()) >= self.iteration:
            self.sent = True
            if self.how == "sigterm":
                next(r for r in cluster.roles if r.name == "oracle").process.send_signal(signal.SIGTERM)
                return
            stopped = subprocess.run([sys.executable, "launch.py", "stop", "--coordinator", str(cluster.oracle_address)],
                                     cwd=ROOT, env={**os.environ, TOKEN_ENV: TOKEN}, capture_output=True, text=True)
            assert stopped.returncode == 0, stopped.stderr
            assert "ends at its next checkpoint" in stopped.stderr


@pytest.mark.parametrize("how", ["sigterm", pytest.param("stop", marks=pytest.mark.nightly)])
def test_a_stopped_stream_ends_at_its_next_checkpoint(tmp_path: Path, how: str) -> None:
    """No end is set: the stream trains until it is stopped (SIGTERM to the oracle, or
    ``launch.py stop``), which ends it at the next checkpoint; the run ends there,
    bit-identical to offline over as many batches."""
    parts = split_sample(tmp_path / "parts")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    open_ended = {"oracle": {"mode": "bagpipe", "cache_rows": 450}, "train": {"batch_size": 32},
                  "checkpoint": {"every": 7}}
    spec = write_spec(tmp_path, "stopped", open_ended, data=data_section(str(incoming / "*.tsv"), watch=True))
    job = build_job(load_spec(spec))
    assert job.iterations == OPEN_END  # the roles that never read the stream
    stop = StopAt(tmp_path / "run", 20, how)
    writer = start_writer(incoming, parts, 5, tmp_path / "run")
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN, on_poll=stop)
    finally:
        writer.kill()  # the run ends before the stream does
    assert stop.sent
    n = orjson.loads(final_paths(result.run_dir).info.read_bytes())["iterations"]
    assert n > 20 and n % 7 == 0, n
    assert latest_complete(job.spec.checkpoint.dir, job.spec.ps.num_shards) == n - 1
    offline = offline_reference(tmp_path, parts, "bagpipe", iterations=n)
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(offline)))


def test_until_ends_a_stream_there(tmp_path: Path) -> None:
    parts = split_sample(tmp_path / "parts")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    spec = write_spec(tmp_path, "until", {"oracle": {"mode": "local"}, "train": {"batch_size": 32}},
                      data=data_section(str(incoming / "*.tsv"), watch=True))
    job = build_job(load_spec(spec))
    writer = start_writer(incoming, parts, 6, tmp_path / "run")
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN, until=37)
    finally:
        writer.kill()  # the run ends before the stream does
    assert orjson.loads(final_paths(result.run_dir).info.read_bytes())["iterations"] == 37
    offline = offline_reference(tmp_path, parts, "local", iterations=37)
    assert_identical(final_model(job, result.run_dir), as_final(reference_for(offline)))


def test_a_stream_exports_a_base_then_deltas_that_read_back_as_full_exports(tmp_path: Path) -> None:
    """[export] every 10 iterations, at checkpoints every 5, and the last checkpoint as the run
    ends: the chain read back at its last link is the full export of that checkpoint, bit for
    bit; freshness is in the summary."""
    parts = split_sample(tmp_path / "parts")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    extra = {"checkpoint": {"every": 5, "keep": 0}, "export": {"dir": str(tmp_path / "exports"), "every_iterations": 10}}
    spec = write_spec(tmp_path, "exported", overrides("bagpipe", **extra), data=data_section(str(incoming / "*.tsv"),
                                                                                            watch=True))
    job = build_job(load_spec(spec))
    writer = start_writer(incoming, parts, 4, tmp_path / "run")
    try:
        run_cluster(job, tmp_path / "run", token=TOKEN)
    finally:
        writer.wait(30)
    links = ExportChain.read(tmp_path / "exports").links
    assert [x.kind for x in links] == ["base"] + ["delta"] * (len(links) - 1) and len(links) >= 5
    due = links[:-1]  # the last is the run's last checkpoint, exported as the run ends
    assert all(b.checkpoint - a.checkpoint >= 10 for a, b in zip(due, due[1:])) and links[-1].checkpoint == 99
    last = links[-1].checkpoint
    export_model(open_checkpoint(job, last), tmp_path / "full", chunk_rows=1000)
    chain, full = load_export(tmp_path / "exports"), load_export(tmp_path / "full")
    assert all(np.array_equal(a, b) for a, b in zip(chain.tables, full.tables, strict=True))
    assert all(torch.equal(chain.model.state_dict()[k], v) for k, v in full.model.state_dict().items())
    summary = orjson.loads((job.spec.checkpoint.dir / "stream" / "summary.json").read_bytes())
    assert summary["exports"] == len(links) and 0 < summary["freshness_s_p50"] <= summary["freshness_s_p99"]


def test_the_online_example_runs_as_its_comment_says(tmp_path: Path) -> None:
    """examples/online.toml fed by examples/feed_stream.py (their folders moved here)."""
    incoming = tmp_path / "incoming"
    text = (ROOT / "examples" / "online.toml").read_text()
    for old, new in (('path = "../runs/online/incoming/*.tsv"', f'path = "{incoming}/*.tsv"'),
                     ("[checkpoint]\n", f'[checkpoint]\ndir = "{tmp_path / "checkpoints"}"\n'),
                     ("[export]\n", f'[export]\ndir = "{tmp_path / "exports"}"\n')):
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "online.toml").write_text(text)
    job = build_job(load_spec(tmp_path / "online.toml"))
    feeder = subprocess.Popen([sys.executable, "examples/feed_stream.py", "--every", "0.3", "--to", str(incoming)],
                              cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        result = run_cluster(job, tmp_path / "run", token=TOKEN)
    finally:
        feeder.kill()
    assert orjson.loads(final_paths(result.run_dir).info.read_bytes())["iterations"] == 60
    links = ExportChain.read(tmp_path / "exports").links
    # the base at the first checkpoint; a checkpoint due while an export runs is passed over
    due = links[:-1]  # the last is the run's last checkpoint, exported as the run ends
    assert links[0].checkpoint == 9 and all(b.checkpoint - a.checkpoint >= 20 for a, b in zip(due, due[1:]))
    assert links[-1].checkpoint == 59
    assert all((x.checkpoint + 1) % 10 == 0 for x in links)
    assert load_export(tmp_path / "exports").manifest.origin.iterations == links[-1].checkpoint + 1
