"""Small trainer records and runs for the launcher's tests: every figure a test states about
`two_trainer_run` is worked out by hand from it."""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.summary import RunSummary, summarise
from trainer.records import EvalRecord, FinalRecord, IterationRecord, Record
from trainer.timing import PHASES


def it_rec(iteration: int, time: float, **over: Any) -> IterationRecord:
    """An iteration record with small defaults; `phases` entries override the zero phases."""
    fields: dict[str, Any] = {
        "samples": 100, "loss": 0.5, "uses": 10, "hits": 5, "fetch_rows": 5, "fetch_bytes": 500,
        "write_back_rows": 4, "write_back_bytes": 400, "sync_rows": 2, "sync_bytes": 200, "join_rows": 1,
    }
    phases = {p: 0.0 for p in PHASES} | over.pop("phases", {})
    return IterationRecord(iteration=iteration, time=time, phases=phases, **(fields | over))


def eval_rec(iteration: int, auc: float, log_loss: float, count: int) -> EvalRecord:
    return EvalRecord(split="progressive", iteration=iteration, time=100.0 + iteration, auc=auc,
                      log_loss=log_loss, count=count)


def two_trainer_run() -> dict[int, list[Record]]:
    """Two trainers, iterations 0..3; every figure below is worked out by hand from these."""
    t0 = [
        it_rec(0, 10.0, samples=100, uses=10, hits=0, fetch_bytes=1000, loss=0.9,
               phases={"forward": 1.0}),
        it_rec(1, 10.5, samples=100, uses=10, hits=5, fetch_bytes=100, phases={"forward": 0.1}),
        it_rec(2, 11.0, samples=100, uses=10, hits=6, fetch_bytes=200, loss=0.5,
               phases={"forward": 0.2}),
        it_rec(3, 12.0, samples=100, uses=10, hits=7, fetch_bytes=300, loss=0.4,
               phases={"forward": 0.3}),
    ]
    t1 = [
        it_rec(0, 10.1, samples=60, uses=20, hits=0, fetch_bytes=2000, loss=0.9,
               phases={"forward": 1.0}),
        it_rec(1, 10.4, samples=60, uses=20, hits=10, fetch_bytes=400, phases={"forward": 0.3}),
        it_rec(2, 11.2, samples=60, uses=20, hits=12, fetch_bytes=500, loss=0.8,
               phases={"forward": 0.4}),
        it_rec(3, 11.9, samples=50, uses=20, hits=14, fetch_bytes=600, loss=0.6,
               phases={"forward": 0.5}),
    ]
    t0 += [eval_rec(1, 0.6, 0.7, 100), eval_rec(3, 0.7, 0.5, 100), FinalRecord(time=13.0, iterations=4)]
    t1 += [eval_rec(3, 0.8, 0.4, 300), FinalRecord(time=13.0, iterations=4)]
    return {0: t0, 1: t1}


def summary_of(mode: str, sps: float, hit: float, fetch: float, sync: float) -> RunSummary:
    """The summary of `two_trainer_run` with these figures in place of its own."""
    base = summarise(two_trainer_run(), mode=mode, global_batch=160)
    return dataclasses.replace(base, samples_per_s=sps, iteration_time_s=0.02, hit_rate=hit,
                               fetch_bytes_per_iter=fetch, sync_bytes_per_iter=sync)
