#!/usr/bin/env python3
"""Recovery time per role: kill -9 one role of a local 2 x 2 run a few iterations after a
checkpoint. A PS shard or the oracle is restarted alone while the trainers wait, or (for
comparison, and always for a trainer) every role restarts from the latest complete
checkpoint.

For each case it reports the time from the kill to the first iteration finished with the
new process up, the time until training is past where it was at the kill, and what
restarting the whole job from scratch would cost: the time a fresh start takes to get there.

    python bench/recovery.py --quick --json runs/bench/recovery.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cluster import LocalCluster, run_cluster  # noqa: E402
from common.job import build_job  # noqa: E402
from common.report import RunTail  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402

TOKEN = "recovery-bench"
CASES = (("ps-0", True), ("ps-0", False), ("oracle", True), ("oracle", False), ("trainer-1", False))


def sections(iterations: int, every: int, out: Path, alone: bool) -> dict[str, dict]:
    return {
        "oracle": {"lookahead": 20, "prefetch_lead": 4, "cache_rows": 16384},
        "ps": {"shards": 2},
        "trainers": {"count": 2},
        "data": {"format": "synthetic", "rows": iterations * 1024 + 2048, "top1_share": 0.92},
        "model": {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [256, 64, 16], "top_mlp": [256, 64]},
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": 1024, "max_iterations": iterations},
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
        self.high = -1  # the furthest iteration finished at the kill
        self.first_cluster: LocalCluster | None = None
        self.restarted: float | None = None
        self.first_new: float | None = None
        self.past: float | None = None

    def __call__(self, cluster: LocalCluster) -> None:
        self.first_cluster = self.first_cluster or cluster
        if self.killed is not None and self.restarted is None and self._replaced(cluster):
            self.restarted = time.time()  # the new process is up: later records needed it
        for trainer, records in self.tail.poll().items():
            for r in (r for r in records if r["kind"] == "iter"):
                if self.killed is None:
                    self.done[trainer] = r["iteration"]
                    continue
                if self.restarted is not None and r["time"] > self.restarted:
                    self.first_new = self.first_new or r["time"]
                if r["iteration"] > self.high and self.past is None:
                    self.past = r["time"]
        if self.killed is None and self._all_reached():
            self.reached_kill_point = time.time()
            target = next(r for r in cluster.roles if r.name == self.role)
            self.high = max(self.done.values())
            os.kill(target.process.pid, signal.SIGKILL)
            self.killed, self.killed_pid = time.time(), target.process.pid

    def _replaced(self, cluster: LocalCluster) -> bool:
        if cluster is not self.first_cluster:
            return True  # every role restarted
        return next(r for r in cluster.roles if r.name == self.role).process.pid != self.killed_pid

    def _all_reached(self) -> bool:
        return len(self.done) == 2 and min(self.done.values()) >= self.kill_at


def measure(role: str, alone: bool, iterations: int, every: int, kill_at: int, out: Path) -> dict:
    folder = out / f"{role}-{'alone' if alone else 'all'}"
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.toml"
    spec_path.write_text(spec_toml(f"recovery-{role}", 5, sections(iterations, every, folder, alone)))
    job = build_job(load_spec(spec_path))
    watch = Watch(folder / "run", role, kill_at)
    result = run_cluster(job, folder / "run", token=TOKEN, on_poll=watch)
    if watch.killed is None or watch.first_new is None or watch.past is None or watch.reached_kill_point is None:
        raise SystemExit(f"{role}: the run did not reach its kill point or did not recover")
    return {
        "role": role,
        "restarted": str(result.restarts[0]) if result.restarts else "none",
        "kill_at": kill_at,
        "recovery_s": watch.first_new - watch.killed,
        "past_kill_point_s": watch.past - watch.killed,
        "from_scratch_s": watch.reached_kill_point - watch.started,
        "run_s": result.seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run (a few minutes)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/recovery"))
    args = parser.parse_args()
    iterations, every = (60, 10) if args.quick else (200, 20)
    kill_at = iterations * 3 // 4 + 2  # a couple of iterations after a checkpoint
    rows = [measure(role, alone, iterations, every, kill_at, args.out) for role, alone in CASES]
    print(f"\nkill -9 at iteration {kill_at} of {iterations}, checkpoint every {every} iterations, T = 2, S = 2")
    print(f"{'restarted':<26} {'kill -> first new iter':>23} {'kill -> past kill point':>24} "
          f"{'from scratch to there':>22} {'speed-up':>9} {'whole run':>10}")
    for r in rows:
        print(f"{r['restarted']:<26} {r['recovery_s']:>21.2f} s {r['past_kill_point_s']:>22.2f} s "
              f"{r['from_scratch_s']:>20.2f} s {r['from_scratch_s'] / r['past_kill_point_s']:>8.1f}x {r['run_s']:>8.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"iterations": iterations, "every": every, "roles": rows}, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
