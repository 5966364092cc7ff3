"""What the model's own compute costs in each mode, with nothing else running beside it:
forward, backward and the dense optimizer step of one trainer on the same batches, in this
process, its rows served by the PS stores in process (`launcher.inprocess`).

    python bench/compute_cpu.py [--modes bagpipe no-cache] [--iterations 200] [--rounds 3]

A mode decides where rows live, never what the model computes on them: each trainer gathers
the rows its inputs read from its cache tensor, and the rest is the same model on the same
values. In a cluster on two cores, though, `bench/e2e.py` has shown bagpipe's forward and
backward at anywhere from 4% less to 19% more CPU than no-cache's on the same batches, from
run to run: the work bagpipe overlaps with compute (the PS client process, which shares
the trainer's core, the shards serving prefetches, the oracle planning ahead, the
background sums) runs beside it and takes its core and caches, where no-cache's trainer
sleeps through it. This script takes the environment away to show what is the modes' own.

One trainer (T = 1) trains on the e2e benchmark's per-trainer slice (`--batch`, default
1,024: half of `bench/e2e.py --quick`'s global 2,048) of its synthetic Criteo-like data,
with its DLRM and optimizers. Per mode: the training thread's CPU time in each compute
phase (`trainer.timing`), the median over the measured iterations (the first fifth left
out), then the median over rounds; rounds alternate the modes. `--smoke`: a small model
and tables, 20 iterations, one round.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from bench.e2e import SIZES, sections  # noqa: E402
from common.job import Job, build_job  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402
from launcher.inprocess import lone_engine, plan_steps, store_rows  # noqa: E402
from trainer.timing import COMPUTE_PHASES  # noqa: E402

NAME = "compute_cpu"
SEED = 3


def job_of(mode: str, batch: int, iterations: int, smoke: bool, folder: Path) -> Job:
    """The e2e benchmark's job (its --smoke size with `smoke`) for one trainer of `batch`."""
    size = SIZES["smoke" if smoke else "quick"]
    size = dataclasses.replace(size, batch=batch, iterations=iterations)
    base = sections(size)
    body = {**base, "oracle": {**base["oracle"], "mode": mode}, "ps": {"shards": 1},
            "trainers": {"count": 1, "min_count": 1}, "checkpoint": {"dir": str(folder / "checkpoints")}}
    path = folder / f"{mode}.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(spec_toml(f"compute-cpu-{mode}", SEED, body))
    return build_job(load_spec(path))


def measure(job: Job, steps: list, warmup: int, round_: int) -> dict[str, float]:
    """One trainer through every step: the median CPU ms per iteration of each compute phase
    over the iterations after `warmup`."""
    engine, comm = lone_engine(job, store_rows(job), f"{NAME}-{job.spec.oracle.mode}-{round_}")
    per_phase: dict[str, list[float]] = {p: [] for p in COMPUTE_PHASES}
    for i, step in enumerate(steps):
        engine.step(step.directive, step.labels, step.dense)
        engine.timer.end_iteration()
        if i >= warmup:
            for phase, seconds in engine.timer.compute_cpu.items():
                per_phase[phase].append(seconds * 1e3)
    engine.drain()
    comm.close()
    return {p: statistics.median(v) for p, v in per_phase.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["bagpipe", "no-cache"],
                        choices=["bagpipe", "no-cache", "static-cache"])
    parser.add_argument("--batch", type=int, default=1024, help="the trainer's batch (default 1,024)")
    parser.add_argument("--iterations", type=int, help="per mode and round (default 200; 20 with --smoke)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3; 1 with --smoke)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/compute_cpu"), help="specs (default %(default)s)")
    add_result_options(parser, NAME, "a small DLRM on small tables, 20 iterations of 128, one round")
    args = parser.parse_args()
    iterations = args.iterations or (20 if args.smoke else 200)
    rounds = args.rounds or (1 if args.smoke else 3)
    batch = 128 if args.smoke and args.batch == 1024 else args.batch
    torch.set_num_threads(1)
    jobs = {mode: job_of(mode, batch, iterations, args.smoke, args.out.resolve()) for mode in args.modes}
    steps = {}
    for mode, job in jobs.items():
        print(f"planning {mode} ...", file=sys.stderr, flush=True)
        steps[mode] = [s[0] for s in plan_steps(job)]
    warmup = iterations // 5
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for r in range(rounds):
        for mode in args.modes:
            runs[mode].append(measure(jobs[mode], steps[mode], warmup, r))
            figures = runs[mode][-1]
            print(f"round {r + 1} {mode:<13}" + "".join(f" {p} {v:7.2f}" for p, v in figures.items()), flush=True)
    per_mode = {mode: _medians(results) for mode, results in runs.items()}
    reference = per_mode.get("no-cache")
    print(f"\nCPU ms per iteration of one trainer's {batch} samples, median of {rounds} rounds")
    print(f"{'mode':<14}{'forward':>9}{'backward':>10}{'dense opt':>11}{'fwd+bwd':>9}{'vs no-cache':>13}")
    for mode, m in per_mode.items():
        ratio = m["forward_backward"] / reference["forward_backward"] if reference else float("nan")
        m["vs_no_cache"] = ratio
        print(f"{mode:<14}{m['forward']:>9.2f}{m['backward']:>10.2f}{m['dense_optimizer']:>11.2f}"
              f"{m['forward_backward']:>9.2f}{ratio:>12.3f}x")
    config = config_of(args, iterations=iterations, rounds=rounds, batch=batch, warmup=warmup)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"per_mode": per_mode, "rounds": {m: r for m, r in runs.items()}},
                  headline=headline(per_mode), smoke=args.smoke)


def _medians(results: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {p: statistics.median(r[p] for r in results) for p in COMPUTE_PHASES}
    both = [r["forward"] + r["backward"] for r in results]
    out["forward_backward"] = statistics.median(both)
    out["forward_backward_range"] = [min(both), max(both)]
    return out


def headline(per_mode: dict[str, dict[str, Any]]) -> Table:
    """Per mode: CPU ms per iteration in forward, backward, the dense step, forward +
    backward with its spread over rounds, and forward + backward against no-cache's."""
    columns = ("mode", "forward ms", "backward ms", "dense opt ms", "fwd+bwd ms", "spread", "vs no-cache")
    return Table(columns, tuple(
        (mode, m["forward"], m["backward"], m["dense_optimizer"], m["forward_backward"],
         f"{m['forward_backward_range'][0]:.2f}–{m['forward_backward_range'][1]:.2f}", m["vs_no_cache"])
        for mode, m in per_mode.items()))


if __name__ == "__main__":
    main()
