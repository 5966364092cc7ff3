"""Every role of a real local cluster is a Prometheus scrape target: the oracle and PS
shards on their HTTP/1.1 ports, each trainer on its own. A scraper (urllib, no token) polls
them all while the run goes on; the last page each role served is checked against the run's
own records. The trainers linger until a scrape has read their final totals, so the last
page is final. The model is the documented example (`examples/my_model.py`), so a `[model]
factory` is also imported by real trainer processes here."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from common.job import build_job
from common.spec import load_spec
from launcher.cluster import LocalCluster, run_cluster
from tests.cluster_helpers import TOKEN, write_spec
from tests.prometheus_text import Scrape, parse
from trainer.scrape import COUNTERS
from trainer.records import IterationRecord, MetricsRecord, read_records, read_run
from trainer.timing import PHASES

pytestmark = pytest.mark.slow
METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


class Scraper:
    """Called on each launcher poll: scrapes every role that listens, keeps its last page."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.last: dict[str, Scrape] = {}

    def __call__(self, cluster: LocalCluster) -> None:
        for name, url in self.targets(cluster).items():
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    self.last[name] = parse(answer.read().decode())
            except OSError:  # not listening yet, or already gone
                continue

    def targets(self, cluster: LocalCluster) -> dict[str, str]:
        urls = {r.name: f"http://{r.info['host']}:{r.info['http1_port']}/metrics" for r in cluster.roles if r.info}
        for trainer in cluster.trainers():
            log = self.run_dir / f"{trainer.name}.jsonl"
            records = read_records(log) if log.exists() else []
            urls |= {trainer.name: r.url for r in records if isinstance(r, MetricsRecord)}
        return urls


def test_every_role_serves_sane_metrics_to_the_end(tmp_path: Path) -> None:
    overrides = {"trainers": {"count": 2}, "cluster": {"metrics_linger_s": 60}}
    model = {"factory": "examples.my_model:build", "embedding_dim": 8, "deep_mlp": [16]}
    job = build_job(load_spec(write_spec(tmp_path, "scraped", overrides, model=model)))
    scraper = Scraper(tmp_path / "run")
    run_cluster(job, tmp_path / "run", token=TOKEN, on_poll=scraper)

    n, shards, trainers = job.spec.train.max_iterations, job.spec.ps.num_shards, job.spec.trainers.count
    assert set(scraper.last) == {"oracle", *(f"ps-{s}" for s in range(shards)), *(f"trainer-{j}" for j in range(trainers))}
    records = read_run(tmp_path / "run", trainers)
    for j in range(trainers):
        check_trainer(scraper.last[f"trainer-{j}"], [r for r in records[j] if isinstance(r, IterationRecord)], n)
    fetched = sum(scraper.last[f"trainer-{j}"].value("bagpipe_fetched_rows_total") for j in range(trainers))
    written = sum(scraper.last[f"trainer-{j}"].value("bagpipe_written_back_rows_total") for j in range(trainers))
    ps = [scraper.last[f"ps-{s}"] for s in range(shards)]
    # The PS also serves the held-out evaluation's fetches and the write-backs of the last
    # boundaries, which no iteration record counts.
    assert sum(p.value("bagpipe_rows_total", op="fetch") for p in ps) >= fetched > 0
    assert sum(p.value("bagpipe_rows_total", op="write_back") for p in ps) >= written > 0
    oracle = scraper.last["oracle"]
    assert oracle.value("bagpipe_iterations_planned_total") == oracle.value("bagpipe_run_iterations") == n
    assert oracle.value("bagpipe_planner_key_uses_total") == n * job.spec.train.batch_size * job.layout.num_tables
    assert oracle.value("bagpipe_planner_key_uses_per_second") > 0
    documented = METRICS_DOC.read_text()
    for role, page in scraper.last.items():
        assert not [f for f in page.kinds if f"`{f}`" not in documented and f"`{f}{{" not in documented], role
    everyone = {str(j): float(n) for j in range(trainers)}
    assert oracle.by_label("bagpipe_trainer_position", "trainer") == everyone
    assert oracle.by_label("bagpipe_steps_sent_total", "trainer") == everyone
    assert oracle.by_label("bagpipe_steps_ahead", "trainer") == dict.fromkeys(everyone, 0.0)
    assert oracle.by_label("bagpipe_streams_open", "trainer") == dict.fromkeys(everyone, 0.0)


def check_trainer(last: Scrape, iterations: list[IterationRecord], n: int) -> None:
    """The final page equals the sums of the trainer's own records."""
    assert len(iterations) == n
    assert last.value("bagpipe_finished") == 1
    assert last.value("bagpipe_iterations_trained_total") == n
    assert last.value("bagpipe_last_iteration") == n - 1
    for key, (name, _) in COUNTERS.items():
        assert last.value(f"bagpipe_{name}") == sum(getattr(r, key) for r in iterations), name
    assert 0 < last.value("bagpipe_hit_rate") < 1  # bagpipe mode: some rows reused, some fetched
    assert last.value("bagpipe_hit_rate") == last.value("bagpipe_row_hits_total") / last.value("bagpipe_row_uses_total")
    phases = last.by_label("bagpipe_phase_seconds_total", "phase")
    assert set(phases) == set(PHASES) and all(s >= 0 for s in phases.values())
    assert phases["forward"] > 0 and phases["backward"] > 0
