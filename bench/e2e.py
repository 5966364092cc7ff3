#!/usr/bin/env python3
"""End-to-end throughput of every mode and TorchRec on the same data, model and cluster, in one run.

T = 2 trainers, S = 2 PS shards, DLRM, synthetic Criteo-like data (Criteo Kaggle's 26 table
cardinalities, 33.8 M rows, top 1% of rows = 92% of accesses), a cache far below the table
sizes. Prints samples/s, iteration time, hit rate and MB moved per iteration with ratios to
`local` and `no-cache`, then where an iteration's time goes (forward, backward, dense
optimizer, machinery: everything else); its results (bench/results/e2e.json, or `--json`)
hold them per mode, `--plot` writes a PNG.

TorchRec (`bench/torchrec_baseline.py`) trains the same job on the same batches with the same
dense model, optimizers, learning rates and thread count: tables sharded table-wise by
`DistributedModelParallel`, row-wise Adagrad fused into backward. Its forward and backward
include its all-to-alls; it moves no rows through a PS, so its traffic columns are zero and
its hit rate n/a. It is optional: `pip install --no-deps -r bench/requirements-torchrec.txt`
(never without --no-deps: it would replace torch). Without it the row is skipped, saying so.

Steady state: the oracle plans while the trainers train, as it does through an epoch of
thousands of iterations. It runs `max_ahead` (64) iterations ahead of the slowest trainer,
so over a run's last 64 iterations it has nothing left to plan and the trainers have the
cores to themselves: those are left out of every figure (TorchRec's too), as is the first
fifth of the run (start-up, first fetches, lazy initialisation). Iterations: 400 per mode
with --quick (256 measured), 600 without.

Data: the synthetic rows are written once as a preprocessed directory (`--out`/data, kept for
later runs of the same rows) and every mode reads its batches from it, as a real job reads
its preprocessed data set; TorchRec's ranks hold the same batches before their clock starts.
An oracle generating the rows on the fly would spend 2 to 4 ms of CPU per iteration (at
2,048 samples) on what no real job does, on the cores the trainers use.

`--rounds N` runs every mode and TorchRec in turn, N times over, and reports for each the run
with the median samples/s (with an even N, the lower of the middle two) and the spread
(min..max) of samples/s, with the median of each mode's per-round ratio to TorchRec: on a
shared machine one run says little, and runs of one round share the load of their minutes.

Memory and CPU: the launcher samples every role's RSS and CPU time about once a second
(`launcher.memory`); for each mode's reported run the benchmark prints, per role (oracle,
each PS shard, each trainer), the RSS at the end of the warm-up, at the end of training, the
peak, the growth per 1,000 iterations after the warm-up (a least-squares slope) and the CPU
time per measured iteration, which shows where the machine's cores went; the results add the
curve points, and each run's folder gets `memory.png`. TorchRec's ranks are sampled the same
way, named as trainers. A long run with a small batch checks that memory stays flat:

    python bench/e2e.py --quick
    python bench/e2e.py --quick --rounds 3
    python bench/e2e.py --shaped 1gbit          (root: PS behind a 1 Gbit/s link)
    python bench/e2e.py --quick --modes bagpipe --no-torchrec --iterations 5000 --batch 256
    python bench/e2e.py --quick --fast-compute  (a small dense model: the balance of a GPU trainer)

CPU against cores: a last table adds up every role's CPU per measured iteration and divides it
by this machine's cores. Where that comes close to the iteration time, as it does on two
cores with five processes, the roles share the cores and a mode is faster only by doing less
work in some role: a trainer's phases then also take the time the other roles run on its core
(bagpipe's forward, while the PS serves the prefetches the boundary issued), and its critical
path does not decide its speed.

`--smoke` runs the same code on a small job in seconds (bagpipe only unless `--modes` says
otherwise, 30 iterations of 128 on tables of 1,000 rows, the oracle 8 iterations ahead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import (  # noqa: E402
    SMOKE_RESULTS, Table, add_result_options, config_of, results_path, torchrec_baseline, write_results,
)
from common.checkpoints import final_paths  # noqa: E402
from common.data.preprocessed import read_manifest  # noqa: E402
from common.data.spec import parse_data_spec  # noqa: E402
from common.data.synthetic import synthetic_config, write_synthetic  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.job import build_job  # noqa: E402
from common.spec import MODES, load_spec, spec_toml  # noqa: E402
from launcher.cluster import PsHost, run_cluster  # noqa: E402
from launcher.memory import (  # noqa: E402
    RssCurve, RssFigures, format_figure, read_rss, rss_curves, summarise_rss,
)
from launcher.plots import plot_modes, plot_rss  # noqa: E402
from launcher.summary import HELPERS, RunSummary, iteration_series, summarise  # noqa: E402
from launcher.text import compare_bytes, compare_modes  # noqa: E402
from trainer.records import Record, read_run  # noqa: E402

NAME = "e2e"
TOKEN = "e2e-bench"
SEED = 3
MAX_AHEAD = 64
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder, in its run folder
DLRM = {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [512, 256, 64, 16], "top_mlp": [512, 256]}
#: `--fast-compute`: the same DLRM with small MLPs, its forward and backward about a tenth of
#: DLRM's here, so that this machine shows the balance of a GPU trainer, whose compute is
#: fast and whose machinery (the boundary, sums, copies, the PS client) is what remains.
FAST_DLRM = {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [64, 16], "top_mlp": [64]}


@dataclass(frozen=True, kw_only=True)
class Size:
    """What the full run, --quick and --smoke differ in. `table_sizes` empty: Criteo Kaggle's
    26 cardinalities (33.8 M rows)."""

    iterations: int
    batch: int
    cache_rows: int
    max_ahead: int = MAX_AHEAD
    table_sizes: tuple[int, ...] = ()
    model: Mapping[str, Any] = field(default_factory=lambda: dict(DLRM))


SIZES = {
    "full": Size(iterations=600, batch=4096, cache_rows=65536),
    "quick": Size(iterations=400, batch=2048, cache_rows=32768),
    "smoke": Size(iterations=30, batch=128, cache_rows=2048, max_ahead=8, table_sizes=(1000,) * 26,
                  model={"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}),
}  # fmt: skip


def sections(size: Size, data: Path | None = None) -> dict[str, dict]:
    """The benchmark's job; its rows generated on the fly, or read from `data` (`prepare_data`)."""
    # Absolute: a spec's relative paths are relative to the spec's folder, not to ours.
    rows = {"format": "preprocessed", "path": str(data.resolve())} if data else synthetic_rows(size)
    return {
        "cluster": {"request_timeout_s": 120, "fetch_timeout_s": 300},
        "oracle": {"lookahead": 100, "prefetch_lead": 8, "cache_rows": size.cache_rows, "max_ahead": size.max_ahead},
        "ps": {"shards": 2},
        "trainers": {"count": 2},
        "data": rows,
        "model": dict(size.model),
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": size.batch, "epochs": 1, "max_iterations": size.iterations},
    }


def synthetic_rows(size: Size) -> dict[str, Any]:
    """The [data] section of the benchmark's synthetic rows: enough for `size.iterations`."""
    rows = {"format": "synthetic", "rows": size.iterations * size.batch + 4096, "top1_share": 0.92}
    return {**rows, "table_sizes": list(size.table_sizes)} if size.table_sizes else rows


def prepare_data(size: Size, folder: Path) -> Path:
    """The benchmark's synthetic rows as a preprocessed directory in `folder`, written unless
    one of the same rows is there already."""
    spec = parse_data_spec(synthetic_rows(size), base_dir=folder)
    path = folder / f"synthetic-{spec.rows}"
    with contextlib.suppress(ConfigError):
        if read_manifest(path).config == synthetic_config(spec):
            return path
    print(f"writing {spec.rows:,} synthetic rows to {path} ...", file=sys.stderr, flush=True)
    write_synthetic(spec, path, progress=True)
    return path


def warmup_of(iterations: int) -> int:
    """Iterations left out at the start of every summary: start-up, first fetches, lazy
    initialisation."""
    return max(2, iterations // 5)


def measured_of(iterations: int, max_ahead: int = MAX_AHEAD) -> int:
    """Iterations every summary measures: all but the warm-up and the last `max_ahead`, which
    the oracle planned before they began (it plans that far ahead of the slowest trainer)."""
    return iterations - warmup_of(iterations) - max_ahead


@dataclass(frozen=True)
class ModeRun:
    """One run of a mode: its summary and every role's RSS (MB) and CPU time (TorchRec's
    roles are its ranks, named as trainers)."""

    summary: RunSummary
    rss: Mapping[str, RssFigures] = field(default_factory=dict)
    curves: Mapping[str, RssCurve] = field(default_factory=dict)


def run_mode(mode: str, base: dict, out: Path, ps_host: PsHost | None) -> ModeRun:
    spec_path = out / f"{mode}.toml"
    run_dir = out / mode
    spec_path.write_text(spec_toml(f"e2e-{mode}", SEED, mode_sections(mode, base, run_dir)))
    job = build_job(load_spec(spec_path))
    print(f"running {mode} ...", file=sys.stderr, flush=True)
    run_cluster(job, run_dir, token=TOKEN, ps_host=ps_host)
    drop_saved_tables(run_dir)
    return _mode_run(run_dir, mode, base)


def mode_sections(mode: str, base: dict, run_dir: Path) -> dict[str, dict]:
    """The job of `mode`: the benchmark's, its checkpoints (the PS shards' final snapshots) in
    its run folder rather than under the working directory's runs/."""
    return {**base, "oracle": {**base["oracle"], "mode": mode}, "checkpoint": {"dir": str(run_dir / CHECKPOINTS)}}


def run_torchrec(base: dict, out: Path) -> ModeRun:
    spec_path = out / f"{torchrec_baseline.MODE}.toml"
    spec_path.write_text(spec_toml(f"e2e-{torchrec_baseline.MODE}", SEED, base))
    print(f"running {torchrec_baseline.MODE} ...", file=sys.stderr, flush=True)
    run_dir = out / torchrec_baseline.MODE
    torchrec_baseline.run(spec_path, run_dir, warmup=warmup_of(base["train"]["max_iterations"]))
    return _mode_run(run_dir, torchrec_baseline.MODE, base)


def drop_saved_tables(run_dir: Path) -> None:
    """Delete the tables a finished run saved: the whole table a `local` run writes at its
    end (2.2 GB here) and the PS shards' final snapshots in `run_dir`/checkpoints (140 MB).
    No benchmark reads them, and three rounds of every mode would leave gigabytes behind."""
    final = final_paths(run_dir)
    final.table.unlink(missing_ok=True)
    final.state.unlink(missing_ok=True)
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)


def _mode_run(run_dir: Path, mode: str, base: dict) -> ModeRun:
    """A finished run's figures over the benchmark's window (`measured_of`)."""
    iterations, max_ahead = base["train"]["max_iterations"], base["oracle"]["max_ahead"]
    warmup = warmup_of(iterations)
    records = read_run(run_dir, 2)
    summary = summarise(records, mode=mode, global_batch=base["train"]["batch_size"], warmup=warmup,
                        cooldown=max_ahead, trainers=2)
    return ModeRun(summary, *_memory(run_dir, records, warmup, iterations - max_ahead))


def _memory(
    run_dir: Path, records: Mapping[int, list[Record]], warmup: int, cpu_until: int
) -> tuple[dict[str, RssFigures], dict[str, RssCurve]]:
    """Every role's RSS and CPU figures and curves from the samples of a run in `run_dir`."""
    series = iteration_series(records, trainers=2)
    curves = rss_curves(read_rss(run_dir), series.iterations, series.end_time)
    plot_rss(curves, warmup, run_dir / "memory.png")
    return summarise_rss(curves, warmup, cpu_until=cpu_until), curves


def median_run(runs: Sequence[ModeRun]) -> ModeRun:
    """The run with the median samples/s; with an even count, the lower of the middle two, so
    that every figure shown comes from one real run."""
    return sorted(runs, key=lambda r: r.summary.samples_per_s)[(len(runs) - 1) // 2]


def spread_table(rounds: Mapping[str, Sequence[ModeRun]]) -> str:
    """Per mode: median, min and max samples/s over the rounds and, when TorchRec ran, the
    median of the per-round ratios to it (runs of one round saw about the same load)."""
    base = rounds.get(torchrec_baseline.MODE)
    head = f"{'mode':<14}{'median':>12}{'min':>12}{'max':>12}" + (f"{'vs torchrec':>13}" if base else "")
    lines = [head, "-" * len(head)]
    for name, runs in rounds.items():
        rates = [r.summary.samples_per_s for r in runs]
        line = f"{name:<14}{statistics.median(rates):>12,.1f}{min(rates):>12,.1f}{max(rates):>12,.1f}"
        if base:
            line += f"{statistics.median(r / b.summary.samples_per_s for r, b in zip(rates, base)):>12.2f}x"
        lines.append(line)
    return "\n".join(lines)


def phase_table(summaries: Mapping[str, RunSummary]) -> str:
    """Mean ms per iteration and trainer: the model's own work, the rest (machinery), the
    total, and last the forward and backward in the training thread's CPU time: beside their
    wall time, it tells more work from waiting for a core the other roles hold."""
    columns = (("forward", 10), ("backward", 10), ("dense opt", 11), ("machinery", 11), ("total", 10),
               ("fwd+bwd CPU", 13))
    head = f"{'mode':<14}" + "".join(f"{name:>{width}}" for name, width in columns)
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        cpu = s.compute_cpu_s.get("forward", math.nan) + s.compute_cpu_s.get("backward", math.nan)
        seconds = (s.phase_s["forward"], s.phase_s["backward"], s.phase_s["dense_optimizer"],
                   s.machinery_s, sum(s.phase_s.values()), cpu)
        lines.append(f"{name:<14}" + "".join(
            f"{'n/a':>{width}}" if math.isnan(v) else f"{1e3 * v:>{width},.2f}"
            for v, (_, width) in zip(seconds, columns)
        ))
    return "\n".join(lines)


def thread_table(summaries: Mapping[str, RunSummary]) -> str:
    """A trainer process's CPU µs per sample by thread (mean over trainers): the training
    thread in and out of the model's compute, every other thread, and the busiest of them."""
    head = (f"{'mode':<14}{'compute':>10}{'training else':>15}{'other threads':>15}{'helper process':>16}"
            "  busiest other threads")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        cpu = s.cpu_us_per_sample
        if not cpu:
            lines.append(f"{name:<14}{'n/a':>10}{'n/a':>15}{'n/a':>15}{'n/a':>16}")
            continue
        others = sorted(((v, k.removeprefix("thread ")) for k, v in cpu.items() if k.startswith("thread ")), reverse=True)
        busiest = ", ".join(f"{k} {v:,.1f}" for v, k in others[:3])
        helper = f"{cpu[HELPERS]:,.1f}" if HELPERS in cpu else "-"
        lines.append(f"{name:<14}{cpu['training_thread_compute']:>10,.1f}{cpu['training_thread_other']:>15,.1f}"
                     f"{cpu['other_threads']:>15,.1f}{helper:>16}  {busiest}")
    return "\n".join(lines)


def machinery_cpu_table(summaries: Mapping[str, RunSummary]) -> str:
    """The training thread's CPU µs per sample outside compute, by phase (``phase <name>`` of
    `cpu_per_sample`; `other` is what no phase timed: records, statistics). Modes whose
    records lack the split are left out; empty if none has it."""
    by_mode = {name: {k.removeprefix("phase "): v for k, v in s.cpu_us_per_sample.items() if k.startswith("phase ")}
               for name, s in summaries.items()}
    by_mode = {name: phases for name, phases in by_mode.items() if phases}
    if not by_mode:
        return ""
    phases = list(dict.fromkeys(p for phases in by_mode.values() for p in phases))
    widths = [max(len(p), 6) + 2 for p in phases]
    head = f"{'mode':<14}" + "".join(f"{p:>{w}}" for p, w in zip(phases, widths))
    lines = [head, "-" * len(head)]
    for name, figures in by_mode.items():
        lines.append(f"{name:<14}" + "".join(f"{figures.get(p, math.nan):>{w},.2f}" for p, w in zip(phases, widths)))
    return "\n".join(lines)


def rss_table(runs: Mapping[str, ModeRun], warmup: int, cpu_until: int) -> str:
    """Per mode and role: RSS at the end of the warm-up and of training, its peak (start-up
    and final saves included), its fitted growth per 1,000 iterations after the warm-up
    (n/a in a run with fewer than 1,000 iterations after it) and its CPU time per iteration
    over the measured iterations."""
    head = (f"{'mode':<14}{'role':<12}{'warm-up end':>13}{'end':>10}{'peak':>10}{'MB/1k it':>10}"
            f"{'CPU ms/it':>11}")
    lines = [f"RSS in MB (after iteration {warmup:,}, until training ended) and CPU time per iteration "
             f"(iterations {warmup:,} to {cpu_until:,})", head, "-" * len(head)]
    for name, run in runs.items():
        for i, f in enumerate(run.rss.values()):
            growth = "n/a" if math.isnan(f.growth_mb_per_1k) else f"{f.growth_mb_per_1k:+.2f}"
            lines.append(f"{name if i == 0 else '':<14}{f.role:<12}{f.warm_mb:>13,.1f}{f.end_mb:>10,.1f}"
                         f"{f.peak_mb:>10,.1f}{growth:>10}{format_figure(f.cpu_ms_per_iter):>11}")
    return "\n".join(lines)


def cores_table(runs: Mapping[str, ModeRun], cores: int) -> str:
    """Per mode: every role's CPU per measured iteration added up, divided by this machine's
    cores, against the iteration time. Where the two are close, the roles share the cores
    and an iteration takes as long as all their work does, whatever its critical path holds:
    a mode is then faster only by doing less work, in any role."""
    head = f"{'mode':<14}{'all roles CPU ms/it':>21}{f'/ {cores} cores':>12}{'iteration ms':>14}{'ratio':>8}"
    lines = ["All roles' CPU against the iteration (both per measured iteration)", head, "-" * len(head)]
    for name, run in runs.items():
        total = sum(f.cpu_ms_per_iter for f in run.rss.values())
        iteration_ms = run.summary.iteration_time_s * 1e3
        ratio = "n/a" if math.isnan(total) else f"{iteration_ms / (total / cores):.2f}x"
        lines.append(f"{name:<14}{format_figure(total):>21}{format_figure(total / cores):>12}"
                     f"{iteration_ms:>14,.1f}{ratio:>8}")
    return "\n".join(lines)


def figures(run: ModeRun, runs: Sequence[ModeRun]) -> dict[str, Any]:
    """The JSON figures of a mode: those of its median run, and samples/s of all `runs`; each
    role's RSS figures with the points of its curve ([iterations done, MB], at most 1,000)."""
    s = run.summary
    rates = [r.summary.samples_per_s for r in runs]
    rss = {role: {**f.to_json(), "points": run.curves[role].points()} for role, f in run.rss.items()}
    return {"samples_per_s": s.samples_per_s, "hit_rate": s.hit_rate,
            "fetch_bytes_per_iter": s.fetch_bytes_per_iter, "sync_bytes_per_iter": s.sync_bytes_per_iter,
            "write_back_bytes_per_iter": s.write_back_bytes_per_iter, "iteration_time_s": s.iteration_time_s,
            "phase_s": s.phase_s, "compute_cpu_s": s.compute_cpu_s, "machinery_s": s.machinery_s,
            "bytes_per_iter": s.bytes_per_iter,
            # a trainer process's CPU µs per sample, by thread (launcher.summary.cpu_per_sample)
            "trainer_cpu_us_per_sample": s.cpu_us_per_sample,
            "rounds_samples_per_s": rates,
            "median_samples_per_s": statistics.median(rates), "min_samples_per_s": min(rates),
            "max_samples_per_s": max(rates), "rss": rss,
            "cpu_ms_per_iter_all_roles": sum(f.cpu_ms_per_iter for f in run.rss.values())}


def torchrec_choice(parser: argparse.ArgumentParser, wanted: bool | None) -> tuple[bool, str | None]:
    """Whether to run TorchRec, and why not when it was not turned off but cannot run."""
    if wanted is False:
        return False, None
    reason = torchrec_baseline.unavailable()
    if reason and wanted:
        parser.error(reason)
    return reason is None, reason


def run_rounds(
    modes: Sequence[str], with_torchrec: bool, base: dict, rounds: int, out: Path, shaped: str | None
) -> dict[str, list[ModeRun]]:
    """Every mode, then TorchRec, `rounds` times over; each run's summary, by mode, in order."""
    shaping: contextlib.AbstractContextManager[PsHost | None] = contextlib.nullcontext(None)
    if shaped:
        from bench.netshape import shaped_ps_host

        shaping = shaped_ps_host(shaped)
    runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
    if with_torchrec:
        runs[torchrec_baseline.MODE] = []
    with shaping as ps_host:
        for r in range(rounds):
            round_dir = out / f"round-{r + 1}"
            round_dir.mkdir(parents=True, exist_ok=True)
            for mode in modes:
                runs[mode].append(run_mode(mode, base, round_dir, ps_host))
            if with_torchrec:
                runs[torchrec_baseline.MODE].append(run_torchrec(base, round_dir))
    return runs


def parse_args() -> tuple[argparse.Namespace, Size]:
    """The arguments, and the size of the job they ask for."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer iterations")
    parser.add_argument("--iterations", type=int,
                        help="iterations per mode (default 400 quick, 600 full; the first fifth and the "
                             f"last {MAX_AHEAD} are not measured)")
    parser.add_argument("--batch", type=int, help="global batch (default 2048 quick, 4096 full)")
    parser.add_argument("--modes", help=f"comma-separated subset of the modes (default {','.join(MODES)}; "
                                         "bagpipe with --smoke)")
    parser.add_argument("--torchrec", action=argparse.BooleanOptionalAction, default=None,
                        help="add the TorchRec baseline (default: when torchrec is importable)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run everything this many times, in turn; report medians")
    parser.add_argument("--shaped", metavar="RATE", help="put the PS behind a veth link shaped to RATE (e.g. 1gbit); root")
    parser.add_argument("--fast-compute", action="store_true",
                        help="a DLRM with small MLPs (forward and backward about a tenth of DLRM's here): the "
                             "balance of a GPU trainer")
    parser.add_argument("--ps-client", choices=("thread", "process"), default="thread",
                        help="where each trainer's PS client runs ([trainers] ps_client; default thread)")
    parser.add_argument("--plot", type=Path, help="write a PNG comparing the modes here")
    parser.add_argument("--out", type=Path, help=f"specs, logs and records (default runs/bench/{NAME}; "
                                                 f"with --smoke {SMOKE_RESULTS}/{NAME})")
    add_result_options(parser, NAME, "bagpipe alone, 30 iterations of 128 on small tables")
    args = parser.parse_args()
    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    base = SIZES[kind]
    size = dataclasses.replace(base, iterations=args.iterations or base.iterations, batch=args.batch or base.batch)
    if args.fast_compute and not args.smoke:
        size = dataclasses.replace(size, model=dict(FAST_DLRM))
    measured = measured_of(size.iterations, size.max_ahead)
    if measured < 2:
        parser.error(f"--iterations {size.iterations} leaves {measured} to measure: the first fifth and "
                     f"the last {size.max_ahead} are left out")
    args.modes = [m for m in (args.modes or ("bagpipe" if args.smoke else ",".join(MODES))).split(",") if m]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.out = args.out or (SMOKE_RESULTS / NAME if args.smoke else Path("runs/bench") / NAME)
    args.with_torchrec, args.torchrec_skipped = torchrec_choice(parser, args.torchrec)
    return args, size


def main() -> int:
    args, size = parse_args()
    iterations, batch, cache_rows, max_ahead = size.iterations, size.batch, size.cache_rows, size.max_ahead
    base = sections(size, prepare_data(size, args.out / "data"))
    base["trainers"]["ps_client"] = args.ps_client
    with_torchrec, skipped = args.with_torchrec, args.torchrec_skipped
    if skipped:
        print(f"TorchRec skipped: {skipped}", file=sys.stderr, flush=True)
    rounds = run_rounds(args.modes, with_torchrec, base, args.rounds, args.out, args.shaped)
    medians = {m: median_run(runs) for m, runs in rounds.items()}
    summaries = {m: run.summary for m, run in medians.items()}
    link = f"PS behind a {args.shaped} tbf-shaped veth link" if args.shaped else "loopback, unshaped"
    median = f", the median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"\n{iterations} iterations per mode ({measured_of(iterations, max_ahead)} measured: the first "
          f"{warmup_of(iterations)} and the last {max_ahead}, which the oracle has planned already, excluded), "
          f"global batch {batch}, C = {cache_rows} rows per trainer, {link}{median}")
    print(compare_modes(summaries))
    if args.rounds > 1:
        print(f"\nsamples/s over {args.rounds} rounds")
        print(spread_table(rounds))
    print("\nms per iteration and trainer "
          "(machinery: all but forward, backward and the dense optimizer)")
    print(phase_table(summaries))
    print("\ntrainer process CPU µs per sample of its slice, by thread")
    print(thread_table(summaries))
    if by_phase := machinery_cpu_table(summaries):
        print("\ntraining thread CPU µs per sample outside compute, by phase")
        print(by_phase)
    print("\npayload MB per iteration and trainer, by kind (TorchRec's all-to-alls not counted)")
    print(compare_bytes(summaries))
    print()
    print(rss_table({m: run for m, run in medians.items() if run.rss}, warmup_of(iterations), iterations - max_ahead))
    print()
    print(cores_table({m: run for m, run in medians.items() if run.rss}, len(os.sched_getaffinity(0))))
    if with_torchrec and args.shaped:
        print(f"(torchrec's all-to-alls run over loopback: only the PS is behind the {args.shaped} link)")
    if skipped:
        print(f"(TorchRec skipped: {skipped})")
    per_mode = {m: figures(run, rounds[m]) for m, run in medians.items()}
    config = config_of(args, iterations=iterations, warmup=warmup_of(iterations), cooldown=max_ahead,
                       batch_size=batch, cache_rows=cache_rows, table_sizes=list(size.table_sizes) or "criteo-kaggle",
                       model=dict(size.model), modes=args.modes, torchrec_skipped=skipped)
    # Each variant keeps results of its own (docs/benchmarks.md shows each): e2e/fast-compute, ...
    variant = "/".join([NAME, *(["fast-compute"] if args.fast_compute else []),
                        *([f"shaped-{args.shaped}"] if args.shaped else []),
                        *(["ps-client-process"] if args.ps_client == "process" else [])])
    write_results(results_path(variant.replace("/", "-"), args.json, args.smoke), bench=variant, config=config,
                  figures={"modes": per_mode}, headline=headline(per_mode), smoke=args.smoke)
    if args.plot:
        plot_modes(summaries, args.plot)
    return 0


def headline(per_mode: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per mode: samples/s of the median run and their spread over the rounds, hit rate,
    iteration time, payload fetched and the machinery's ms per iteration."""
    columns = ("mode", "samples/s", "min", "max", "hit rate %", "iteration ms", "fetch MB/iter", "machinery ms")
    rows = tuple((mode, f["median_samples_per_s"], f["min_samples_per_s"], f["max_samples_per_s"], 100 * f["hit_rate"],
                  1e3 * f["iteration_time_s"], f["fetch_bytes_per_iter"] / 1e6, 1e3 * f["machinery_s"])
                 for mode, f in per_mode.items())  # fmt: skip
    return Table(columns, rows)


if __name__ == "__main__":
    sys.exit(main())
