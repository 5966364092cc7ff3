#!/usr/bin/env python3
"""Recovery time per role: kill -9 one role of a local 2 x 2 run a few iterations after a
checkpoint. A PS shard or the oracle is restarted alone while the trainers wait, or (for
comparison, and always for a trainer) every role restarts from the latest complete
checkpoint.

For each case it reports the time from the kill to the first iteration finished with the
new process up ("not needed" when the trainers finished on what they had: an oracle's
steps are streamed ahead, up to the HTTP/2 window), the time the failure cost (the run's
length minus that of the same run uninterrupted), and what restarting the whole job from
scratch would cost instead: the time a fresh start takes to get back to the kill point; and
whether the run ended with exactly the parameters of the uninterrupted one.

    python bench/recovery.py --quick

An elastic job (``[trainers] min_count = 1``, ``max_count = 2``, `--elastic`, on by default)
is measured both ways: from a trainer's kill to the first iteration trained with T - 1 (the
regroup waits `rejoin_timeout_s` for the dead trainer, here 5 s), and from a new trainer's
registration to the first iteration trained with T + 1 (it waits for the next checkpoint,
then the regroup), in a run three times as long; its run ends bit-identical to the same
terms resumed by hand (`--resume` with each term's trainer count at each term's checkpoint).

`--smoke` kills a PS shard once, restarting it alone, in a run of 60 iterations of 256 on
small tables and a small model.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import SMOKE_RESULTS, Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.checkpoints import ps_dir  # noqa: E402
from common.job import Job, build_job  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402
from launcher.cluster import JOIN_SCRIPT, LocalCluster, run_cluster  # noqa: E402
from trainer.records import IterationRecord, RunTail, TermRecord, read_run, terms_of  # noqa: E402
from ps.checkpoint import load_snapshot  # noqa: E402

NAME = "recovery"
TOKEN = "recovery-bench"
CASES = (("ps-0", True), ("ps-0", False), ("oracle", True), ("oracle", False), ("trainer-1", False))
MODEL = {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [256, 64, 16], "top_mlp": [256, 64]}
SMOKE_MODEL = {"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}


def sections(iterations: int, every: int, out: Path, alone: bool, *, smoke: bool = False) -> dict[str, dict]:
    """The job; with `smoke`, batches of 256 on 26 tables of 1,000 rows and a small model."""
    batch = 256 if smoke else 1024
    data = {"format": "synthetic", "rows": iterations * batch + 2048, "top1_share": 0.92}
    return {
        "oracle": {"lookahead": 20, "prefetch_lead": 4, "cache_rows": 4096 if smoke else 16384},
        "ps": {"shards": 2},
        "trainers": {"count": 2},
        "data": {**data, "table_sizes": [1000] * 26} if smoke else data,
        "model": SMOKE_MODEL if smoke else MODEL,
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": batch, "max_iterations": iterations},
        "checkpoint": {"dir": str(out / "checkpoints"), "every": every, "restart": True, "restart_alone": alone},
    }


class Watch:
    """Kills `role` once both trainers finished `kill_at`, and times what follows."""

    def __init__(self, run_dir: Path, role: str, kill_at: int) -> None:
        self.tail = RunTail(run_dir, 2)
        self.role, self.kill_at = role, kill_at
        self.started = time.time()
        self.done: dict[int, int] = {}
        self.reached_kill_point: float | None = None
        self.killed: float | None = None
        self.killed_pid: int | None = None
        self.first_cluster: LocalCluster | None = None
        self.restarted: float | None = None
        self.first_new: float | None = None

    def __call__(self, cluster: LocalCluster) -> None:
        self.first_cluster = self.first_cluster or cluster
        if self.killed is not None and self.restarted is None and self._replaced(cluster):
            self.restarted = time.time()  # the new process is up: later records needed it
        for trainer, records in self.tail.poll().items():
            for r in (r for r in records if isinstance(r, IterationRecord)):
                if self.killed is None or r.time <= self.killed:  # read late on a busy machine
                    self.done[trainer] = max(self.done.get(trainer, -1), r.iteration)
                elif self.restarted is not None and r.time > self.restarted:
                    self.first_new = self.first_new or r.time
        if self.killed is None and self._all_reached():
            self.reached_kill_point = time.time()
            target = next(r for r in cluster.roles if r.name == self.role)
            os.kill(target.process.pid, signal.SIGKILL)
            self.killed, self.killed_pid = time.time(), target.process.pid

    def _replaced(self, cluster: LocalCluster) -> bool:
        if cluster is not self.first_cluster:
            return True  # every role restarted
        return next(r for r in cluster.roles if r.name == self.role).process.pid != self.killed_pid

    def _all_reached(self) -> bool:
        return len(self.done) == 2 and min(self.done.values()) >= self.kill_at


def job_in(folder: Path, name: str, iterations: int, every: int, alone: bool, smoke: bool,
           elastic: bool = False) -> Job:
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.toml"
    job = sections(iterations, every, folder, alone, smoke=smoke)
    if elastic:
        job["trainers"].update(min_count=1, max_count=2)
        job["cluster"] = {"rejoin_timeout_s": ELASTIC_REJOIN_S}
        job["checkpoint"]["restart"] = False
    spec_path.write_text(spec_toml(name, 5, job))
    return build_job(load_spec(spec_path))


def uninterrupted(iterations: int, every: int, folder: Path, smoke: bool, *, runs: int = 2) -> float:
    """The run's length without a kill, in `folder`: the last of `runs` runs (the first
    starts the launcher's zygotes, which every later run of this process finds warm)."""
    job = job_in(folder, "recovery", iterations, every, True, smoke)
    return [run_cluster(job, folder / "run", token=TOKEN).seconds for _ in range(runs)][-1]


def same_final_model(job: Job, folder: Path, reference: Path) -> bool:
    """Whether a run ended with exactly the dense parameters and table rows of another."""
    dense = [torch.load(f / "run" / "final" / "dense.pt") for f in (folder, reference)]
    if dense[0].keys() != dense[1].keys() or not all(torch.equal(dense[0][k], dense[1][k]) for k in dense[0]):
        return False
    last = job.spec.train.max_iterations
    for shard in range(job.spec.ps.num_shards):
        a, b = (load_snapshot(ps_dir(f / "checkpoints", shard), last)[0] for f in (folder, reference))
        if not all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("local", "rows", "state", "versions")):
            return False
    return True


ELASTIC_REJOIN_S = 5.0
_LOG_TIME = re.compile(rb"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*waits to join", re.MULTILINE)


class ElasticWatch:
    """Kills trainer 1 once both trainers finished `kill_at`; once the job trains with one
    trainer, starts another (`join-trainer.sh`); times both changes from the records."""

    def __init__(self, run_dir: Path, kill_at: int) -> None:
        self.run_dir, self.kill_at = run_dir, kill_at
        self.tail = RunTail(run_dir, 2)
        self.done: dict[int, int] = {}
        self.term = 0
        self.killed: float | None = None
        self.joiner: subprocess.Popen | None = None
        self.shrunk: float | None = None  # the first iteration's end with T - 1
        self.grown: float | None = None  # ... with T + 1

    def __call__(self, cluster: LocalCluster) -> None:
        for trainer, records in self.tail.poll().items():
            for r in records:
                if isinstance(r, TermRecord):
                    self.term = max(self.term, r.term)
                elif isinstance(r, IterationRecord) and self.killed is None:
                    self.done[trainer] = max(self.done.get(trainer, -1), r.iteration)
                elif isinstance(r, IterationRecord) and self.term == 1 and self.shrunk is None:
                    self.shrunk = r.time
                elif isinstance(r, IterationRecord) and self.term == 2 and self.grown is None:
                    self.grown = r.time
        if self.killed is None and len(self.done) == 2 and min(self.done.values()) >= self.kill_at:
            target = next(r for r in cluster.roles if r.name == "trainer-1")
            os.kill(target.process.pid, signal.SIGKILL)
            self.killed = time.time()
        if self.shrunk is not None and self.joiner is None:
            log = open(self.run_dir / "logs" / "trainer-joined.log", "ab")
            self.joiner = subprocess.Popen(["sh", str(self.run_dir / JOIN_SCRIPT)], stdout=log, stderr=log,
                                           start_new_session=True)

    def registered(self) -> float:
        """When the new trainer's registration reached the oracle, after the kill (its log,
        which earlier runs in this folder appended to, says so)."""
        assert self.killed is not None
        log = (self.run_dir / "logs" / "oracle.log").read_bytes()
        times = [datetime.strptime(m.decode(), "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in _LOG_TIME.findall(log)]
        after = [t for t in times if t >= self.killed]
        if not after:
            raise SystemExit("the new trainer never registered")
        return after[0]


def measure_elastic(iterations: int, every: int, kill_at: int, out: Path, baseline_s: float, smoke: bool) -> list[dict]:
    """Two rows: the elastic job shrinking after a kill, and growing after a registration."""
    folder = out / "elastic"
    job = job_in(folder, "recovery-elastic", iterations, every, True, smoke, elastic=True)
    watch = ElasticWatch(folder / "run", kill_at)
    try:
        result = run_cluster(job, folder / "run", token=TOKEN, on_poll=watch)
    finally:
        if watch.joiner is not None:
            watch.joiner.wait(60)
    if watch.killed is None or watch.shrunk is None or watch.grown is None:
        raise SystemExit(f"the elastic run did not shrink and grow (term {watch.term}): lengthen it (--iterations)")
    terms = terms_of(read_run(folder / "run", 2))
    by_hand = resumed_by_hand(out, iterations, every, smoke, [(t.first_iteration, t.trainers) for t in terms])
    registered = watch.registered()
    common = {"kill_at": kill_at, "killed_at_iteration": max(watch.done.values()), "run_s": result.seconds,
              "uninterrupted_s": baseline_s, "lost_s": result.seconds - baseline_s, "from_scratch_s": None,
              "bit_identical": same_final_model(job, folder, by_hand), "terms": [vars(t) for t in terms]}
    return [
        {**common, "role": "trainer-1", "restarted": "elastic: T - 1", "recovery_s": watch.shrunk - watch.killed},
        {**common, "role": "new trainer", "restarted": "elastic: T + 1", "recovery_s": watch.grown - registered,
         "killed_at_iteration": None},
    ]


def resumed_by_hand(out: Path, iterations: int, every: int, smoke: bool, terms: list[tuple[int, int]]) -> Path:
    """The elastic run's terms, each run by hand: (first iteration, trainers) up to the next
    term's first iteration, then resumed with the next count; the folder of the last run."""
    folder = out / "elastic-by-hand"
    starts = dict(terms)  # a later term from the same checkpoint takes the place of an earlier one
    firsts = sorted(starts)
    for k, first in enumerate(firsts):
        end = firsts[k + 1] if k + 1 < len(firsts) else iterations
        job = sections(iterations, every, folder, True, smoke=smoke)  # the same data
        job["train"]["max_iterations"] = end
        job["trainers"]["count"] = starts[first]
        folder.mkdir(parents=True, exist_ok=True)
        spec_path = folder / "spec.toml"
        spec_path.write_text(spec_toml("recovery-by-hand", 5, job))
        run_cluster(build_job(load_spec(spec_path)), folder / "run", token=TOKEN, resume=k > 0)
    return folder


def measure(role: str, alone: bool, iterations: int, every: int, kill_at: int, out: Path, baseline_s: float,
            smoke: bool) -> dict:
    folder = out / f"{role}-{'alone' if alone else 'all'}"
    job = job_in(folder, f"recovery-{role}", iterations, every, alone, smoke)
    watch = Watch(folder / "run", role, kill_at)
    result = run_cluster(job, folder / "run", token=TOKEN, on_poll=watch)
    if watch.killed is None or watch.reached_kill_point is None:
        raise SystemExit(f"{role}: the run did not reach its kill point")
    return {
        "role": role,
        "restarted": str(result.restarts[0]) if result.restarts else "none",
        "kill_at": kill_at,
        "killed_at_iteration": max(watch.done.values()),  # the furthest one finished at the kill
        # None: the trainers finished on what they had (an oracle's steps already sent)
        "recovery_s": None if watch.first_new is None else watch.first_new - watch.killed,
        "lost_s": result.seconds - baseline_s,
        "from_scratch_s": watch.reached_kill_point - watch.started,
        "run_s": result.seconds,
        "uninterrupted_s": baseline_s,
        "bit_identical": same_final_model(job, folder, out / "uninterrupted"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run (a few minutes)")
    parser.add_argument("--out", type=Path, help=f"specs, logs and records (default runs/bench/{NAME}; "
                                                 f"with --smoke {SMOKE_RESULTS}/{NAME})")
    parser.add_argument("--iterations", type=int, help="run length (default 60 with --quick or --smoke, else 200)")
    parser.add_argument("--kill-at", type=int,
                        help="iteration to kill at (default: 2 after the checkpoint at 3/4; at half with --smoke)")
    parser.add_argument("--roles", help="comma-separated roles to kill (default ps-0,oracle,trainer-1; ps-0 with --smoke)")
    parser.add_argument("--no-elastic", action="store_true", help="leave out the elastic job's shrink and growth")
    add_result_options(parser, NAME, "one kill, of ps-0 restarted alone, in a small job")
    args = parser.parse_args()
    iterations, every = (60, 10) if args.quick or args.smoke else (200, 20)
    iterations = args.iterations or iterations
    # 2 after a checkpoint: at 3/4, or half way with --smoke, whose short iterations would
    # otherwise let the run end before the kill lands (the watch polls every 0.2 s)
    kill_at = args.kill_at if args.kill_at is not None else iterations * (2 if args.smoke else 3) // 4 + 2
    roles = (args.roles or ("ps-0" if args.smoke else "ps-0,oracle,trainer-1")).split(",")
    cases = [(role, alone) for role, alone in CASES if role in roles][: 1 if args.smoke else None]
    out = args.out or (SMOKE_RESULTS / NAME if args.smoke else Path("runs/bench") / NAME)
    baseline_s = uninterrupted(iterations, every, out / "uninterrupted", args.smoke, runs=1 if args.smoke else 2)
    rows = [measure(role, alone, iterations, every, kill_at, out, baseline_s, args.smoke) for role, alone in cases]
    if not (args.smoke or args.no_elastic):
        # Three times as long: after the kill and the regroup, a new trainer must still start,
        # register and wait for a checkpoint before the run ends.
        elastic_baseline_s = uninterrupted(3 * iterations, every, out / "uninterrupted-elastic", args.smoke, runs=1)
        rows += measure_elastic(3 * iterations, every, iterations // 3 + 2, out, elastic_baseline_s, args.smoke)
    print(f"\nkill -9 once both trainers finished iteration {kill_at} of {iterations}, checkpoint every {every} iterations, T = 2, S = 2; "
          f"the run takes {baseline_s:.1f} s uninterrupted")
    print(f"{'restarted':<26} {'killed after':>12} {'kill -> first new iter':>23} {'time lost':>10} "
          f"{'from scratch instead':>21} {'speed-up':>9} {'bit-identical':>14}")
    for r in rows:
        recovery = "not needed" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        # below half a second the loss is within the noise of two runs' lengths
        scratch = r["from_scratch_s"]
        speedup = f"{scratch / r['lost_s']:.1f}x" if scratch is not None and r["lost_s"] >= 0.5 else "-"
        killed = "-" if r["killed_at_iteration"] is None else r["killed_at_iteration"]
        scratch_text = "-" if scratch is None else f"{scratch:.2f} s"
        print(f"{r['restarted']:<26} {killed:>12} {recovery:>23} {r['lost_s']:>8.2f} s "
              f"{scratch_text:>21} {speedup:>9} {'yes' if r['bit_identical'] else 'NO':>14}")
    if any(r["restarted"].startswith("elastic") for r in rows):
        print(f"elastic: kill -> the first iteration with T - 1 (rejoin_timeout_s = {ELASTIC_REJOIN_S:g} s); "
              "registration -> the first with T + 1 (it waits for the next checkpoint); time lost is the "
              f"whole elastic run's against an uninterrupted one of {3 * iterations} iterations")
    alone = {r["role"]: r["recovery_s"] for r in rows if r["restarted"].endswith("alone")}
    every_role = {r["role"]: r["recovery_s"] for r in rows if r["restarted"].startswith("every role")}
    for role in sorted(set(alone) & set(every_role)):
        if alone[role] is not None and every_role[role] is not None:
            print(f"{role} restarted alone recovers {every_role[role] / alone[role]:.1f}x faster than every role "
                  f"restarted from the checkpoint ({alone[role]:.2f} s against {every_role[role]:.2f} s)")
    figures = {"iterations": iterations, "every": every, "uninterrupted_s": baseline_s, "roles": rows}
    config = config_of(args, iterations=iterations, every=every, kill_at=kill_at, roles=roles, cases=cases,
                       out=out, job=sections(iterations, every, out, True, smoke=args.smoke))
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures=figures,
                  headline=headline(rows), smoke=args.smoke)
    return 0


def headline(rows: list[dict]) -> Table:
    """Per kill: what restarted, the time from the kill to the first new iteration, the time
    lost against the uninterrupted run, what a restart from scratch would have cost, and
    whether the run ended bit-identical."""
    columns = ("restarted", "killed after", "recovery s", "time lost s", "from scratch s", "bit-identical")
    return Table(columns, tuple((r["restarted"], r["killed_at_iteration"], r["recovery_s"], r["lost_s"],
                                 r["from_scratch_s"], r["bit_identical"]) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
