"""Whole clusters over TLS end bit-identical to the same run without it: a local cluster
with throw-away certificates (`launch.py SPEC --tls`), one with mutual TLS, and one whose
spec names its files in [cluster.tls]. Every server of every role speaks TLS (the logs say
so per listener) and the trainers' metrics URLs are https."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.job import build_job
from common.spec import load_spec
from launcher.cluster import TlsChoice, run_cluster
from launcher.inprocess import run_in_process
from tests.cluster_helpers import TOKEN, assert_identical, final_model, write_spec
from tests.tls_fixtures import TlsFiles
from trainer.records import MetricsRecord, read_records

pytestmark = pytest.mark.slow
OVERRIDES = {"train": {"max_iterations": 24}, "checkpoint": {"every": 8}}


def _listeners(run_dir: Path) -> tuple[int, int]:
    """(TLS listeners, plaintext listeners) the roles' logs report."""
    logs = [p.read_text() for p in (run_dir / "logs").glob("*.log")]
    listening = [line for text in logs for line in text.splitlines() if "server listening on" in line]
    tls = sum(line.endswith("(TLS)") for line in listening)
    return tls, len(listening) - tls


# One-way TLS is nightly: in CI mutual TLS runs the same TLS path, and client certificates besides.
@pytest.mark.parametrize("mutual", [pytest.param(False, marks=pytest.mark.nightly), True], ids=["tls", "mutual-tls"])
def test_a_local_cluster_over_tls_ends_bit_identical(tmp_path: Path, mutual: bool) -> None:
    job = build_job(load_spec(write_spec(tmp_path, "over-tls", OVERRIDES)))
    run_dir = tmp_path / "run"
    section = TlsChoice(generate=True, mutual=mutual).section(job.spec, run_dir)
    assert section is not None and section.mutual == mutual and (run_dir / "tls" / "node.key").exists()
    run_cluster(job, run_dir, token=TOKEN, tls=section)
    assert_identical(final_model(job, run_dir), run_in_process(job).model)
    # The oracle and two shards, an HTTP/2 and an HTTP/1.1 port each; a metrics port per trainer.
    assert _listeners(run_dir) == (3 * 2 + job.spec.trainers.count, 0)
    urls = [r.url for j in range(2) for r in read_records(run_dir / f"trainer-{j}.jsonl") if isinstance(r, MetricsRecord)]
    assert len(urls) == 2 and all(u.startswith("https://") for u in urls)


def test_a_spec_with_cluster_tls_runs_over_tls_with_its_own_files(tmp_path: Path, tls_files: TlsFiles) -> None:
    """Its trainers' PS clients run in helper processes (`ps_client = "process"`), which load
    the same files for themselves: the SSL contexts do not cross a process."""
    files = tls_files.mutual
    tls = {"cert": files.cert, "key": files.key, "ca": files.ca, "mutual": True}
    overrides = {**OVERRIDES, "cluster": {"tls": tls}, "trainers": {"ps_client": "process"}}
    job = build_job(load_spec(write_spec(tmp_path, "own-files", overrides)))
    assert job.spec.cluster.tls == files
    run_dir = tmp_path / "run"
    run_cluster(job, run_dir, token=TOKEN, tls=TlsChoice().section(job.spec, run_dir))
    assert_identical(final_model(job, run_dir), run_in_process(job).model)
    assert _listeners(run_dir)[1] == 0
