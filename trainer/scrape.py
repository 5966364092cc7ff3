"""A trainer's Prometheus scrape target: the totals of its iteration records, over HTTP/1.1.

The training loop adds each iteration's record (`trainer.records.IterationRecord`) to an immutable
`TrainerTotals` and publishes the new one with a single reference swap: no lock, nothing on
the hot path but a few additions. Scrapes are answered by a small HTTP/1.1 server on the
trainer's I/O loop, which renders whatever totals are current; it never touches torch.

A trainer serves ``GET /metrics`` and ``GET /v1/health`` without a token, like the PS and
the oracle, on ``[trainers] metrics_address`` (its port + rank; any free port for 0). A
batch job ends between two scrapes, so with ``metrics_linger_s`` > 0 a finished trainer
waits, at most that long, until a scrape has read its final totals.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.errors import ConfigError, Unavailable
from common.prometheus import Registry
from common.runtime import connection_limits
from common.spec import ClusterSpec
from common.transport import Http1Server, Request, Response, Router, Tls
from trainer.records import IterationRecord
from trainer.timing import PHASES

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 16  # scrapes are GETs: no body worth the name

#: `IterationRecord` field -> (counter name, help): each summed over the iterations this process ran.
COUNTERS: Mapping[str, tuple[str, str]] = {
    "samples": ("samples_total", "Training samples in this trainer's slices"),
    "uses": ("row_uses_total", "Embedding rows used (unique rows per iteration)"),
    "hits": ("row_hits_total", "Rows used that were resident before the iteration's fetches"),
    "fetch_rows": ("fetched_rows_total", "Rows fetched from the PS"),
    "fetch_bytes": ("fetched_bytes_total", "Bytes of rows and optimizer state fetched from the PS"),
    "write_back_rows": ("written_back_rows_total", "Rows written back to the PS"),
    "write_back_bytes": ("written_back_bytes_total", "Bytes of rows and optimizer state written back"),
    "sync_rows": ("synced_rows_total", "Rows whose gradients were summed across trainers"),
    "sync_bytes": ("synced_bytes_total", "Bytes all-reduced for embedding sync and joins"),
    "join_rows": ("joined_rows_total", "Rows copied from another trainer's cache (joins)"),
}


@dataclass(frozen=True, kw_only=True)
class TrainerTotals:
    """Sums of one trainer's iteration records; never changed once published."""

    iterations: int = 0
    last_iteration: int = -1  # global: a resumed run starts past 0
    loss: float = math.nan  # the last iteration's
    counts: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    phase_seconds: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    finished: bool = False

    def plus(self, record: IterationRecord) -> TrainerTotals:
        """These totals with one more iteration's `record` added."""
        return TrainerTotals(
            iterations=self.iterations + 1,
            last_iteration=record.iteration,
            loss=record.loss,
            counts={key: total + getattr(record, key) for key, total in self.counts.items()},
            phase_seconds={p: total + record.phases[p] for p, total in self.phase_seconds.items()},
        )

    @property
    def hit_rate(self) -> float:
        uses = self.counts["uses"]
        return self.counts["hits"] / uses if uses else math.nan


def render(totals: TrainerTotals) -> str:
    """The Prometheus text page of `totals`."""
    m = Registry()
    m.set_total("iterations_trained_total", totals.iterations, help="Iterations this trainer ran")
    for key, (name, help) in COUNTERS.items():
        m.set_total(name, totals.counts[key], help=help)
    for phase, seconds in totals.phase_seconds.items():
        m.set_total("phase_seconds_total", seconds, {"phase": phase},
                    help="Seconds of iterations spent in each phase (trainer/timing.py)")
    m.set("hit_rate", totals.hit_rate, help="row_hits_total / row_uses_total (NaN before any use)")
    m.set("last_iteration", totals.last_iteration, help="Global index of the last iteration run")
    m.set("loss", totals.loss, help="Mean loss of the last iteration's slice")
    m.set("finished", int(totals.finished), help="1 once training, evaluation and saving are done")
    return m.render()


class TrainerMetrics:
    """Totals published by the training loop, served to scrapes (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.totals = TrainerTotals()  # replaced, never mutated: readers need no lock
        self._final_read = threading.Event()

    def record(self, record: IterationRecord) -> None:
        """Add one iteration's record (training thread only)."""
        self.totals = self.totals.plus(record)

    def finish(self) -> None:
        """Training and saving are done: the totals are final."""
        self.totals = dataclasses.replace(self.totals, finished=True)

    def wait_final_read(self, timeout_s: float) -> bool:
        """Wait until a scrape has read the final totals, at most `timeout_s`; whether one did."""
        return self._final_read.wait(timeout_s)

    def router(self) -> Router:
        router = Router()
        router.add("GET", "/metrics", self.render_metrics, public=True)
        router.add("GET", "/v1/health", self.health, public=True)
        return router

    async def render_metrics(self, request: Request) -> Response:
        totals = self.totals  # one read: a consistent set
        body = render(totals).encode()
        if totals.finished:
            self._final_read.set()
        return Response(body=body, content_type="text/plain; version=0.0.4")

    async def health(self, request: Request) -> Response:
        totals = self.totals
        return Response.json({"role": "trainer", "rank": self.rank, "iterations": totals.iterations,
                              "finished": totals.finished})


@dataclass(frozen=True)
class ScrapeTarget:
    server: Http1Server
    url: str  # what a Prometheus scrape config names


async def serve(metrics: TrainerMetrics, spec: ClusterSpec, token: str, tls: Tls | None = None) -> ScrapeTarget:
    """Start trainer `metrics.rank`'s scrape target (on the loop that runs this); over TLS
    only, with `tls`."""
    endpoint = spec.trainers.metrics_endpoint(metrics.rank)
    server = Http1Server(
        metrics.router(), host=endpoint.host, port=endpoint.port, token=token,
        max_body_bytes=MAX_BODY_BYTES, limits=connection_limits(spec.cluster), tls=tls,
    )
    try:
        await server.start()
    except Unavailable as exc:  # another trainer or service on this host holds the port, say
        raise ConfigError("trainers.metrics_address", f"trainer {metrics.rank} {exc.message}") from exc
    url = f"{'http' if tls is None else 'https'}://{endpoint.host}:{server.port}/metrics"
    log.info("trainer %d: Prometheus metrics on %s", metrics.rank, url)
    return ScrapeTarget(server, url)
