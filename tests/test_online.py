"""Online training on real clusters (docs/design.md#online-training): a writer process lands
the parts of a Criteo stream in a watched folder at random times while the run trains; the
run ends bit-identical to the data-parallel reference of the offline run over the same parts
in the same order, in every mode, with its plan cut where the trainers caught up with the
data. Killing a role with kill -9 mid-stream and restarting it as any run does loses and
repeats nothing."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from common.job import Job, build_job
from common.spec import load_spec
from launcher.cluster import Restart, run_cluster
from tests.cluster_helpers import TOKEN, as_final, assert_identical, final_model, reference_for, write_spec
from tests.test_recovery import KillAt

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "criteo_kaggle_head8000.tsv"
CUTS = (0, 700, 1000, 1650, 1680, 2400, 3300)  # six parts, one of 30 rows
ITERATIONS = 100  # of 32 rows: the stream holds 103 batches


def split_sample(folder: Path) -> list[Path]:
    """The sample's first rows as parts of uneven sizes, in natural order."""
    folder.mkdir()
    lines = SAMPLE.read_text().splitlines(keepends=True)
    parts = []
    for k, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        parts.append(folder / f"part-{k}.tsv")
        parts[-1].write_text("".join(lines[a:b]))
    return parts


def data_section(path: str | list[str], *, watch: bool) -> dict[str, object]:
    section: dict[str, object] = {"format": "criteo", "path": path, "table_sizes": [97] * 26}
    return section | ({"watch": True, "poll_s": 0.1} if watch else {})


def overrides(mode: str, **extra: dict[str, object]) -> dict[str, dict[str, object]]:
    return {"oracle": {"mode": mode, "cache_rows": 450},
            "train": {"batch_size": 32, "max_iterations": ITERATIONS}, **extra}


def offline_reference(tmp_path: Path, parts: list[Path], mode: str) -> Job:
    spec = write_spec(tmp_path, f"offline-{mode}", overrides(mode), data=data_section([str(p) for p in parts],
                                                                                      watch=False))
    return build_job(load_spec(spec))


def start_writer(incoming: Path, parts: list[Path], seed: int, run_dir: Path) -> subprocess.Popen:
    """The writer: the first part at once, the others while the trainers train."""
    started = run_dir / "trainer-0.jsonl"
    return subprocess.Popen([sys.executable, "-m", "tests.stream_writer", str(incoming), str(seed), str(started),
                             *map(str, parts)], cwd=ROOT)


def segment_ends(job: Job) -> list[int]:
    lines = (job.spec.checkpoint.dir / "stream" / "segments.jsonl").read_bytes().splitlines()
    return [orjson.loads(line)["end"] for line in lines if b"end" in line]


MODES = [pytest.param(m, marks=[] if m in ("bagpipe", "local") else [pytest.mark.nightly])
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
    spec = write_spec(tmp_path, "killed", overrides("bagpipe", **extra), data=data_section(str(incoming / "*.tsv"),
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
