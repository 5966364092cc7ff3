"""A trainer's scrape target: totals of its iteration records, rendered as Prometheus text
and served over a real HTTP/1.1 server on a loopback port (urllib as the scraper)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.spec import Endpoint, load_spec
from tests.cluster_helpers import write_spec
from tests.prometheus_text import Scrape, parse
from trainer.scrape import COUNTERS, ScrapeTarget, TrainerMetrics, TrainerTotals, render, serve
from trainer.io_thread import IoThread
from trainer.records import IterationRecord
from trainer.timing import PHASES


def record(iteration: int, **counts: int) -> IterationRecord:
    """An iteration record as `trainer.main` writes it: `counts` over zeros, phases 0.5 s."""
    return IterationRecord(iteration=iteration, time=0.0, loss=0.25 + iteration,
                           **(dict.fromkeys(COUNTERS, 0) | counts), phases=dict.fromkeys(PHASES, 0.5))


def test_totals_add_records_without_changing_what_was_published() -> None:
    first = TrainerTotals().plus(record(7, uses=10, hits=4, fetch_bytes=300, samples=16))
    second = first.plus(record(8, uses=6, hits=6, sync_bytes=64, samples=16))
    assert (first.iterations, first.counts["uses"], first.counts["fetch_bytes"]) == (1, 10, 300)
    assert (second.iterations, second.last_iteration, second.loss) == (2, 8, 8.25)
    assert second.counts["uses"] == 16 and second.counts["hits"] == 10 and second.counts["samples"] == 32
    assert second.phase_seconds == dict.fromkeys(PHASES, 1.0)
    assert second.hit_rate == 10 / 16
    assert math.isnan(TrainerTotals().hit_rate)


def test_every_counter_and_phase_is_rendered() -> None:
    totals = TrainerTotals().plus(record(0, uses=8, hits=2, write_back_bytes=96, join_rows=3))
    scrape = parse(render(totals))
    assert scrape.value("bagpipe_iterations_trained_total") == 1
    for key, (name, _) in COUNTERS.items():
        assert scrape.value(f"bagpipe_{name}") == totals.counts[key]
        assert scrape.kinds[f"bagpipe_{name}"] == "counter"
    assert scrape.by_label("bagpipe_phase_seconds_total", "phase") == dict.fromkeys(PHASES, 0.5)
    assert scrape.value("bagpipe_hit_rate") == 0.25
    assert (scrape.value("bagpipe_last_iteration"), scrape.value("bagpipe_finished")) == (0, 0)
    assert math.isnan(parse(render(TrainerTotals())).value("bagpipe_hit_rate"))


@pytest.fixture
def io() -> Iterator[IoThread]:
    thread = IoThread()
    yield thread
    thread.close()


def serving(io: IoThread, tmp_path: Path, metrics: TrainerMetrics) -> ScrapeTarget:
    spec = load_spec(write_spec(tmp_path, "exporter", {"cluster": {"token": "secret"}}))
    return io.run(serve(metrics, spec, "secret"))


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as answer:  # no token: metrics are public
        assert answer.headers["content-type"].startswith("text/plain")
        return parse(answer.read().decode())


def test_a_scrape_reads_the_published_totals_and_the_final_read_is_noticed(io: IoThread, tmp_path: Path) -> None:
    metrics = TrainerMetrics(rank=1)
    target = serving(io, tmp_path, metrics)
    try:
        assert scrape(target.url).value("bagpipe_iterations_trained_total") == 0
        metrics.record(record(0, uses=4, hits=1))
        metrics.record(record(1, uses=4, hits=3))
        during = scrape(target.url)
        assert (during.value("bagpipe_iterations_trained_total"), during.value("bagpipe_hit_rate")) == (2, 0.5)
        assert not metrics.wait_final_read(0)  # read, but not yet final
        metrics.finish()
        assert scrape(target.url).value("bagpipe_finished") == 1
        assert metrics.wait_final_read(0)
        health = json.loads(urllib.request.urlopen(target.url.replace("/metrics", "/v1/health"), timeout=10).read())
        assert health == {"role": "trainer", "rank": 1, "iterations": 2, "finished": True}
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(target.url.replace("/metrics", "/v1/stream"), timeout=10)
        assert info.value.code == 404
    finally:
        io.run(target.server.stop())


def test_trainer_j_listens_on_the_spec_port_plus_j(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, "ports", {"trainers": {"count": 4, "metrics_address": "0.0.0.0:9400"}}))
    assert spec.trainers.metrics_endpoint(2) == Endpoint(host="0.0.0.0", port=9402)
    default = load_spec(write_spec(tmp_path, "default", {}))
    assert default.trainers.metrics_endpoint(1) == Endpoint(host="127.0.0.1", port=0)


def test_a_taken_port_is_a_config_error_naming_the_field(io: IoThread, tmp_path: Path) -> None:
    first = serving(io, tmp_path, TrainerMetrics(rank=0))
    try:
        taken = int(first.url.rsplit(":", 1)[1].split("/")[0])
        spec = load_spec(write_spec(tmp_path, "taken", {"trainers": {"metrics_address": f"127.0.0.1:{taken - 1}"}}))
        with pytest.raises(ConfigError, match=f"trainers.metrics_address: trainer 1 cannot listen on 127.0.0.1:{taken}"):
            io.run(serve(TrainerMetrics(rank=1), spec, "secret"))
    finally:
        io.run(first.server.stop())
