"""The write-backs of a run with frequent checkpoints, sent by the trainers' real boundary
protocol and landed on real PS stores in the worst order (docs/design.md, "Checkpoints").

Write-backs from different trainers, or from one trainer in different requests, have no
order between them unless something forces one: each travels on its own, and the PS may
receive them in any order. Here a write-back lands only when it must (`_Shards`), and then
newest version first; each checkpoint is snapshotted once its writes have landed, as the PS
does once every trainer reported it. The plan is the production planner's for a tight cache
over four epochs with a checkpoint every three iterations, where shared rows often leave one
trainer at a checkpoint while another keeps them: that trainer's own write of the next
version may land before the leaving copy's flush.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.directive import Directive
from common.errors import Conflict
from common.job import Job, build_job
from common.spec import load_spec
from oracle.planner import Planner
from oracle.startup import build_workload, planner_config
from ps.startup import shard_config
from ps.store import ShardStore, Snapshot
from tests.cluster_helpers import write_spec
from tests.oracle.test_mutations import FlushIffCopyStays
from trainer.boundary import (
    Action,
    ApplySyncLater,
    Boundary,
    CheckpointsWritten,
    InsertFetched,
    IssueFetches,
    Leave,
    WaitWrites,
)


class _Shards:
    """Real stores of every shard behind a network that lands write-backs in the worst order.

    A write-back stays in flight until something forces it to land: a trainer's bounded
    write lag (`WaitWrites`), a fetch that asks for its version (inserted only once served),
    or the end of the run. Whatever is forced lands newest version first. A row's values are
    its version, so a snapshot shows which write it holds."""

    def __init__(self, job: Job) -> None:
        self.stores = [ShardStore(shard_config(job, s)) for s in range(job.spec.ps.num_shards)]
        self.in_flight: list[tuple[np.ndarray, int, bool]] = []  # keys, version, flush
        self.snapshots: dict[int, list[Snapshot]] = {}  # checkpoint -> each shard's
        self.sent: dict[int, list[int]] = {}  # key -> versions written
        self.fetches: dict[int, list[tuple[int, int]]] = {}  # target -> (key, min_version)
        self.reported: list[int] = []  # checkpoints whose writes were all sent, not yet taken

    def send(self, keys: np.ndarray, version: int, flush: bool) -> None:
        if keys.size:
            self.in_flight.append((keys, version, flush))
        for k in keys.tolist():
            self.sent.setdefault(k, []).append(version)

    def land(self, up_to: int | None = None, key: int | None = None) -> None:
        """Land what is in flight of versions <= `up_to` (or the requests holding `key`)."""
        due = [w for w in self.in_flight if (up_to is None or w[1] <= up_to) and (key is None or key in w[0])]
        self.in_flight = [w for w in self.in_flight if not any(w is d for d in due)]
        for keys, version, flush in sorted(due, key=lambda w: -w[1]):
            for s, store in enumerate(self.stores):
                mine = keys[keys % len(self.stores) == s]
                rows = np.full((mine.size, store.config.dim), version, np.float32)
                state = np.zeros((mine.size, store.config.state_width), np.float32)
                local = store.check_write(mine, rows, state, version, flush=flush)
                store.write_back(local, rows, state, version, flush=flush)

    def snapshot_ready(self) -> None:
        """A shard snapshots checkpoint c once every trainer reported it, which each does
        (off its critical path) once its write-backs of versions <= c have landed."""
        while self.reported and not any(w[1] <= self.reported[0] for w in self.in_flight):
            c = self.reported.pop(0)
            self.snapshots[c] = [store.snapshot(c) for store in self.stores]

    def check_snapshot(self, c: int) -> None:
        """Checkpoint c holds every written row at its newest version <= c, and no other."""
        for s, snap in enumerate(self.snapshots[c]):
            keys = snap.local * len(self.stores) + s
            want = [max((v for v in self.sent.get(k, []) if v <= c), default=-2) for k in keys.tolist()]
            written = snap.versions >= 0  # rows a fetch touched and nobody wrote are -1
            assert np.array_equal(snap.versions[written], np.array(want)[written]), f"checkpoint {c}"
            assert np.array_equal(snap.rows[written, 0], snap.versions[written].astype(np.float32))
            expected = {k for k, vs in self.sent.items() if k % len(self.stores) == s and min(vs) <= c}
            assert set(keys[written].tolist()) == expected, f"checkpoint {c} misses rows"

    def execute(self, step: list[Action]) -> None:
        """One action of every trainer (their plans line up step by step)."""
        for a in step:
            if isinstance(a, WaitWrites):
                self.land(up_to=a.up_to)
            elif isinstance(a, IssueFetches):
                for g in a.groups:
                    waits = g.min_versions >= 0
                    self.fetches.setdefault(g.target, []).extend(zip(g.keys[waits], g.min_versions[waits]))
            elif isinstance(a, InsertFetched):  # served once the versions they ask for landed
                for k, v in self.fetches.pop(a.target, []):
                    self.land(up_to=int(v), key=int(k))
            elif isinstance(a, ApplySyncLater):
                for kind in (False, True):
                    self.send(a.held_keys[a.held_flush == kind], a.iteration, kind)
            elif isinstance(a, Leave):
                for kind in (False, True):
                    self.send(a.keys[~a.hold & (a.flush == kind)], a.iteration, kind)
        if isinstance(step[0], CheckpointsWritten):
            self.reported += step[0].iterations
        self.snapshot_ready()


def _replay(job: Job, directives: list[list[Directive]], boundary: type[Boundary]) -> _Shards:
    shards = _Shards(job)
    trainers = [boundary() for _ in range(job.spec.trainers.count)]
    for ds in directives:
        for step in zip(*(b.plan(d) for b, d in zip(trainers, ds))):
            shards.execute(list(step))
    for step in zip(*(b.drain() for b in trainers)):
        shards.execute(list(step))
    shards.land()
    shards.snapshot_ready()
    return shards


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[list[Directive]]]:
    overrides = {
        "oracle": {"mode": "bagpipe", "cache_rows": 64},
        "train": {"epochs": 4, "max_iterations": 0},
        "checkpoint": {"every": 3},
    }
    job = build_job(load_spec(write_spec(tmp_path_factory.mktemp("spec"), "checkpointed", overrides)))
    workload = build_workload(job)
    planner = Planner(planner_config(job, workload))
    directives = [ds for keys, _, _ in workload.key_batches() for ds in planner.push(keys)]
    return job, directives + planner.finish()


def test_every_checkpoint_is_taken_whatever_order_the_writes_land_in(run: tuple[Job, list[list[Directive]]]) -> None:
    job, directives = run
    leaving_flushes = sum(
        int(np.isin(d.write_slots[d.write_flush == 1], d.leave_slots).sum()) for ds in directives for d in ds
    )
    assert leaving_flushes > 100  # the case this test is about: flushes by a copy that leaves
    shards = _replay(job, directives, Boundary)
    assert sorted(shards.snapshots) == [c for c in range(len(directives)) if (c + 1) % 3 == 0]
    for c in shards.snapshots:
        shards.check_snapshot(c)


def test_flushes_sent_as_plain_write_backs_are_refused(run: tuple[Job, list[list[Directive]]]) -> None:
    """c90f137's trainer sent a flush as a plain write-back where its copy left: the PS
    refuses it once the keeper's newer write has landed, and the checkpoint fails."""
    job, directives = run
    with pytest.raises(Conflict, match="is not newer"):
        _replay(job, directives, FlushIffCopyStays)
