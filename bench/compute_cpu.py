"""What the model's own compute costs in each mode, with nothing else running beside it:
forward, backward and the dense optimizer step of one trainer on the same batches, in this
process, its rows served by the PS stores in process (`launcher.inprocess`).

    python bench/compute_cpu.py [--modes bagpipe no-cache static-cache] [--iterations 300]

A mode decides where rows live, never what the model computes on them: each trainer gathers
the rows its inputs read from its cache tensor, and the rest is the same model on the same
values. In a cluster on two cores, though, `bench/e2e.py` has shown bagpipe's forward and
backward at anywhere from 4% less to 19% more CPU than no-cache's on the same batches, from
run to run: the work bagpipe overlaps with compute (the PS client process, which shares
the trainer's core, the shards serving prefetches, the oracle planning ahead, the
background sums) runs beside it and takes its core and caches, where no-cache's trainer
sleeps through it. This script takes the environment away to show what is the modes' own.

One trainer (T = 1) per mode trains on the e2e benchmark's per-trainer slice (`--batch`,
default 1,024: half of `bench/e2e.py --quick`'s global 2,048) of its synthetic
Criteo-like data, with its DLRM and optimizers. The modes' trainers take turns, one
iteration each and in a rotating order, so that the machine's drift (this one's speed moves
by tens of percent within minutes) falls on every mode alike. Per mode: the training
thread's CPU time in each compute phase (`trainer.timing`), the median over the measured
iterations (the first fifth left out), and forward + backward against no-cache's, the
median of the iteration-by-iteration ratios. `--smoke`: a small model and tables, 20
iterations of 64 samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
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


def measure(jobs: dict[str, Job], steps: dict[str, list], warmup: int) -> dict[str, dict[str, list[float]]]:
    """Every mode's trainer through its steps, taking turns iteration by iteration: per mode
    and compute phase, the CPU ms of each iteration after `warmup`."""
    engines = {mode: lone_engine(job, store_rows(job), f"{NAME}-{mode}") for mode, job in jobs.items()}
    cpu = {mode: {p: [] for p in COMPUTE_PHASES} for mode in jobs}
    modes = list(jobs)
    for i in range(len(next(iter(steps.values())))):
        for mode in modes[i % len(modes):] + modes[: i % len(modes)]:  # a rotating order
            engine, step = engines[mode][0], steps[mode][i]
            engine.step(step.directive, step.labels, step.dense)
            engine.timer.end_iteration()
            if i >= warmup:
                for phase, seconds in engine.timer.compute_cpu.items():
                    cpu[mode][phase].append(seconds * 1e3)
    for engine, comm in engines.values():
        engine.drain()
        comm.close()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["bagpipe", "no-cache", "static-cache"],
                        choices=["bagpipe", "no-cache", "static-cache"])
    parser.add_argument("--batch", type=int, default=1024, help="the trainer's batch (default 1,024)")
    parser.add_argument("--iterations", type=int, help="per mode (default 300; 20 with --smoke)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/compute_cpu"), help="specs (default %(default)s)")
    add_result_options(parser, NAME, "a small DLRM on small tables, 20 iterations of 64")
    args = parser.parse_args()
    iterations = args.iterations or (20 if args.smoke else 300)
    batch = 64 if args.smoke and args.batch == 1024 else args.batch  # half the e2e smoke's 128
    torch.set_num_threads(1)
    jobs = {mode: job_of(mode, batch, iterations, args.smoke, args.out.resolve()) for mode in args.modes}
    steps = {}
    for mode, job in jobs.items():
        print(f"planning {mode} ...", file=sys.stderr, flush=True)
        steps[mode] = [s[0] for s in plan_steps(job)]
    warmup = iterations // 5
    print(f"training {len(jobs)} trainers in turn ...", file=sys.stderr, flush=True)
    cpu = measure(jobs, steps, warmup)
    per_mode = {mode: _medians(phases, cpu.get("no-cache")) for mode, phases in cpu.items()}
    print(f"\nCPU ms per iteration of one trainer's {batch} samples, median of {iterations - warmup} iterations")
    print(f"{'mode':<14}{'forward':>9}{'backward':>10}{'dense opt':>11}{'fwd+bwd':>9}{'vs no-cache':>13}")
    for mode, m in per_mode.items():
        print(f"{mode:<14}{m['forward']:>9.2f}{m['backward']:>10.2f}{m['dense_optimizer']:>11.2f}"
              f"{m['forward_backward']:>9.2f}{m['vs_no_cache']:>12.3f}x")
    config = config_of(args, iterations=iterations, batch=batch, warmup=warmup)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"per_mode": per_mode}, headline=headline(per_mode), smoke=args.smoke)


def _medians(phases: dict[str, list[float]], no_cache: dict[str, list[float]] | None) -> dict[str, Any]:
    """Median CPU ms of each phase and of forward + backward, its quartiles, and the median
    ratio of forward + backward to no-cache's in the same iterations (NaN without no-cache)."""
    both = np.add(phases["forward"], phases["backward"])
    out: dict[str, Any] = {p: float(np.median(v)) for p, v in phases.items()}
    out["forward_backward"] = float(np.median(both))
    out["forward_backward_quartiles"] = np.percentile(both, [25, 75]).tolist()
    reference = np.add(no_cache["forward"], no_cache["backward"]) if no_cache else None
    out["vs_no_cache"] = float(np.median(both / reference)) if reference is not None else float("nan")
    return out


def headline(per_mode: dict[str, dict[str, Any]]) -> Table:
    """Per mode: CPU ms per iteration in forward, backward, the dense step, forward +
    backward with its quartiles, and forward + backward against no-cache's."""
    columns = ("mode", "forward ms", "backward ms", "dense opt ms", "fwd+bwd ms", "quartiles", "vs no-cache")
    return Table(columns, tuple(
        (mode, m["forward"], m["backward"], m["dense_optimizer"], m["forward_backward"],
         "{:.2f}–{:.2f}".format(*m["forward_backward_quartiles"]), m["vs_no_cache"])
        for mode, m in per_mode.items()))


if __name__ == "__main__":
    main()
