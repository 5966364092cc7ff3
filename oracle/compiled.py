"""The planner's numba kernels: whether numba's cache holds them, and compiling them ahead.

Compiling them takes about 13 s on a quiet machine, once per checkout and numba version
(the cache is in the user's folder: oracle/__init__.py). The oracle compiles them before it
reports ready, so that trainers never sit waiting on it; the launcher says so when the
cache is cold.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from common.spec import Mode
from oracle import NUMBA_CACHE_ENV
from oracle.config import PlannerConfig
from oracle.kernels.cache import is_cached
from oracle.planner import KERNELS, Planner, rules_class
from oracle.stats import PlannerStats
from oracle.workers import InProcessPool, ParallelPlanner

log = logging.getLogger(__name__)


def is_compiled(mode: Mode) -> bool:
    """Whether numba's cache holds current code for every kernel `mode`'s rules call."""
    return all(is_cached(kernel) for kernel in (*rules_class(mode).kernels, *KERNELS))


def compile_planner(mode: Mode) -> None:
    """Compile (or load from the cache) every kernel `mode`'s rules call, with the argument
    types of a real run: the production planner plans a small made-up stream, in bagpipe
    mode also as two key partitions (what planner workers run, in this process; the workers
    then load the kernels from the cache)."""
    cold = not is_compiled(mode)
    started = time.perf_counter()
    config = PlannerConfig(
        num_trainers=2, lookahead=2, prefetch_lead=1, capacity=12, mode=mode, checkpoint_every=2,
        total_rows=32, hot_keys=np.arange(2) if mode == "static-cache" else np.zeros(0, np.int64),
    )
    planners = [Planner(config)]
    if mode == "bagpipe":
        parallel = dataclasses.replace(config, workers=2)
        planners.append(ParallelPlanner(parallel, InProcessPool(parallel), PlannerStats(num_trainers=2)))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, config.total_rows, size=(4, 2)) for _ in range(6)]
    for planner in planners:
        for batch in batches:
            planner.push(batch)
        planner.finish()
    if cold:
        log.info("compiled the %s planner in %.1f s; cached in %s for later runs", mode,
                 time.perf_counter() - started, os.environ[NUMBA_CACHE_ENV])
