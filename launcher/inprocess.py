"""A whole run in one process: T trainers as threads, without servers.

Each trainer is a thread running `trainer.startup.build_engine`'s engine over a real gloo
process group built in this process (ranks meet through an in-memory store), so DDP's
dense all-reduce and the embedding sync are the collectives a cluster runs. The PS is
`StoreRows`: the production `ShardStore`s behind a lock, a fetch resolved once its rows
reach the version it asks for. The oracle is the production planner, run ahead over the
whole stream. What this leaves out — HTTP/2, the directive stream, processes — the local
cluster (`launcher.cluster`) has. The equivalence tests run the full mode x model x
optimizer x T matrix through it in seconds, and `bench/gpu_check.py` runs it on CUDA.

Building process groups in-process uses torch's `ProcessGroup._register_backend`, an
internal API (what `torch.distributed.new_group` does underneath): it may need following
on a torch upgrade.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from common.directive import Directive
from common.init import initial_rows
from common.job import Job
from common.keys import local_index, shard_of
from common.steps import Step, trainer_steps
from oracle.live import LivePlanner
from oracle.startup import build_workload, planner_config
from ps.client import Rows
from ps.startup import shard_config
from ps.store import ShardStore
from trainer.collectives import Collectives, calm_gloo_loops
from trainer.device import select_device
from trainer.engine import Engine, IterationStats, RowSource
from trainer.startup import build_engine, seeded_model

TIMEOUT_S = 60.0  # a collective or fetch that waits longer has deadlocked


class StoreRows:
    """`RowSource` over the shards' stores, for trainers in this process.

    A write-back is applied at once; a fetch is served as soon as every row has reached its
    `min_version` (checked again after each write-back), or fails after `TIMEOUT_S`.
    """

    def __init__(self, stores: list[ShardStore]) -> None:
        self.stores = stores
        self._lock = threading.Lock()
        self._waiting: list[tuple[np.ndarray, np.ndarray, concurrent.futures.Future]] = []

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._serve(keys, min_versions, future):
                self._waiting.append((keys, min_versions, future))
        return future

    def release(self, fetched: object) -> None:
        """Nothing to give back: a fetch's rows are arrays of their own."""

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            for s, store in enumerate(self.stores):
                mine = shard_of(keys, len(self.stores)) == s
                if mine.any():
                    local = store.check_write(keys[mine], rows[mine], state[mine], version, flush=flush)
                    store.write_back(local, rows[mine], state[mine], version, flush=flush)
            self._waiting = [w for w in self._waiting if not self._serve(*w)]
        future.set_result(None)
        return future

    def _serve(self, keys: np.ndarray, min_versions: np.ndarray, future: concurrent.futures.Future) -> bool:
        """Resolve `future` if every row is ready (caller holds the lock)."""
        num_shards = len(self.stores)
        shards, local = shard_of(keys, num_shards), local_index(keys, num_shards)
        if not all(store.ready(local[shards == s], min_versions[shards == s]) for s, store in enumerate(self.stores)):
            return False
        out = Rows(
            rows=np.empty((len(keys), self.stores[0].config.dim), np.float32),
            state=np.empty((len(keys), self.stores[0].config.state_width), np.float32),
            versions=np.empty(len(keys), np.int64),
        )
        for s, store in enumerate(self.stores):
            mine = shards == s
            out.rows[mine], out.state[mine], out.versions[mine] = store.gather(local[mine])
        future.set_result(out)
        return True

    def table(self, job: Job) -> tuple[np.ndarray, np.ndarray]:
        """The full (rows, state) the shards hold, initial values where never written."""
        keys = np.arange(job.layout.total_rows, dtype=np.int64)
        table = initial_rows(job.layout, job.spec.seed, keys, job.dim)
        state = np.full((job.layout.total_rows, job.state_width), job.state_init, np.float32)
        for s, store in enumerate(self.stores):
            snap = store.snapshot()
            table[snap.local * len(self.stores) + s] = snap.rows
            state[snap.local * len(self.stores) + s] = snap.state
        return table, state


@functools.cache
def process_groups(world_size: int, name: str = "main") -> list[Any]:
    """`world_size` gloo process groups of one world, one per rank, made once per process and
    `name` (building one takes a TCP mesh; DDP and the engines of later runs share them)."""
    store = dist.HashStore()
    groups: list[Any] = [None] * world_size

    def join(rank: int) -> None:
        prefixed = dist.PrefixStore(f"in-process-{world_size}-{name}", store)
        backend = dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=TIMEOUT_S))
        group = dist.ProcessGroup(prefixed, rank, world_size)
        # CUDA too: DDP's constructor broadcasts the parameters on their device, even at T = 1
        for device in ("cpu", "cuda"):
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        groups[rank] = group

    _run_ranks(world_size, join)
    calm_gloo_loops()
    return groups


@dataclass(frozen=True)
class FinalModel:
    """The parameters a run ends with."""

    dense: dict[str, torch.Tensor]  # rank 0's dense state_dict
    table: np.ndarray  # [total_rows, d]
    state: np.ndarray  # [total_rows, s]


@dataclass(frozen=True, kw_only=True)
class InProcessRun:
    model: FinalModel
    stats: list[list[IterationStats]]  # per trainer, per iteration
    dense_grads: dict[str, torch.Tensor]  # rank 0's averaged dense gradients of the last step


def run_in_process(job: Job, device: Literal["cpu", "cuda"] = "cpu", *,
                   segment_ends: Iterable[int] = ()) -> InProcessRun:
    """Train `job` (any mode) with its trainers as threads of this process, on one torch
    thread, on the CPU or (every trainer on the same GPU) CUDA; the plan cut into segments
    before each iteration of `segment_ends`, as a live stream that ran dry there would be
    (`oracle.live`)."""
    torch.set_num_threads(1)
    world = job.spec.trainers.count
    steps = plan_steps(job, segment_ends)
    local = job.spec.oracle.mode == "local"
    rows = None if local else store_rows(job)
    groups, background = process_groups(world), process_groups(world, "background")
    devices = [select_device(device, 0) for _ in range(world)]
    models = [seeded_model(job, devices[rank]) for rank in range(world)]
    engines: list[Engine | None] = [None] * world
    stats: list[list[IterationStats]] = [[] for _ in range(world)]

    def train(rank: int) -> None:
        comm = Collectives(world_size=world, rank=rank, group=groups[rank], background=background[rank])
        engine = build_engine(job, devices[rank], comm, rows, models[rank])
        engines[rank] = engine
        for iteration in steps:
            step = iteration[rank]
            stats[rank].append(engine.step(step.directive, step.labels, step.dense))
        engine.drain()
        comm.close()

    _run_ranks(world, train)
    first = engines[0]
    assert first is not None
    module = first.model.module
    dense = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    grads = {k: p.grad.cpu().clone() for k, p in module.named_parameters() if p.grad is not None}
    if rows is None:
        table, state = first.cache.rows.cpu().numpy(), first.cache.state.cpu().numpy()
    else:
        table, state = rows.table(job)
    return InProcessRun(model=FinalModel(dense, table, state), stats=stats, dense_grads=grads)


def store_rows(job: Job) -> StoreRows:
    """The PS of `job` in this process: its shards' stores, as they start."""
    return StoreRows([ShardStore(shard_config(job, s)) for s in range(job.spec.ps.num_shards)])


def lone_engine(job: Job, rows: RowSource | None, name: str) -> tuple[Engine, Collectives]:
    """The engine of one trainer (`job` of T = 1) on the CPU, over `rows` (None in local
    mode), with process groups of its own named after `name` (one name per engine in a
    process), and its collectives, to close after its drain."""
    groups, background = process_groups(1, name), process_groups(1, f"{name}-background")
    device = select_device("cpu", 0)
    comm = Collectives(world_size=1, rank=0, group=groups[0], background=background[0])
    return build_engine(job, device, comm, rows, seeded_model(job, device)), comm


def plan_steps(job: Job, segment_ends: Iterable[int] = ()) -> list[list[Step]]:
    """Every iteration's steps, per trainer, from the production planner (cut into segments
    before each of `segment_ends`)."""
    workload = build_workload(job)
    planner = LivePlanner(planner_config(job, workload), ends=segment_ends)
    batches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    steps: list[list[Step]] = []

    def publish(final: list[list[Directive]]) -> None:
        for directives in final:
            steps.append(trainer_steps(directives, *batches.pop(directives[0].iteration)))

    for x, (keys, labels, dense) in enumerate(workload.key_batches(), start=workload.start):
        batches[x] = (labels, dense)
        publish(planner.push(keys))
    publish(planner.finish())
    return steps


def _run_ranks(world_size: int, target: Callable[[int], None]) -> None:
    """Run `target(rank)` on one thread per rank; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            target(rank)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 4)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a trainer thread of {world_size} did not finish")
