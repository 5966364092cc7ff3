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

`--smoke` kills a PS shard once, restarting it alone, in a run of 60 iterations of 256 on
small tables and a small model.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import SMOKE_RESULTS, Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.checkpoints import ps_dir  # noqa: E402
from common.job import Job, build_job  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402
from launcher.cluster import LocalCluster, run_cluster  # noqa: E402
from trainer.records import IterationRecord, RunTail  # noqa: E402
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


def job_in(folder: Path, name: str, iterations: int, every: int, alone: bool, smoke: bool) -> Job:
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.toml"
    spec_path.write_text(spec_toml(name, 5, sections(iterations, every, folder, alone, smoke=smoke)))
    return build_job(load_spec(spec_path))


def uninterrupted(iterations: int, every: int, out: Path, smoke: bool) -> float:
    folder = out / "uninterrupted"
    job = job_in(folder, "recovery", iterations, every, True, smoke)
    return run_cluster(job, folder / "run", token=TOKEN).seconds


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
    baseline_s = uninterrupted(iterations, every, out, args.smoke)
    rows = [measure(role, alone, iterations, every, kill_at, out, baseline_s, args.smoke) for role, alone in cases]
    print(f"\nkill -9 once both trainers finished iteration {kill_at} of {iterations}, checkpoint every {every} iterations, T = 2, S = 2; "
          f"the run takes {baseline_s:.1f} s uninterrupted")
    print(f"{'restarted':<26} {'killed after':>12} {'kill -> first new iter':>23} {'time lost':>10} "
          f"{'from scratch instead':>21} {'speed-up':>9} {'bit-identical':>14}")
    for r in rows:
        recovery = "not needed" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        # below half a second the loss is within the noise of two runs' lengths
        speedup = f"{r['from_scratch_s'] / r['lost_s']:.1f}x" if r["lost_s"] >= 0.5 else "-"
        print(f"{r['restarted']:<26} {r['killed_at_iteration']:>12} {recovery:>23} {r['lost_s']:>8.2f} s "
              f"{r['from_scratch_s']:>19.2f} s {speedup:>9} {'yes' if r['bit_identical'] else 'NO':>14}")
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
