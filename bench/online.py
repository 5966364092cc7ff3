#!/usr/bin/env python3
"""Online training against offline on the same rows (docs/design.md#online-training).

The rows: synthetic Criteo-like ones (top 1% of rows = 92% of accesses) written as Criteo TSV
parts of `PART_BATCHES` batches each. Three runs of the same job (T = 2, S = 2, bagpipe,
a small DLRM):

* **offline**: the parts as a list, all there before the run starts;
* **online, fast**: a watched folder the parts land in at twice the offline run's rate
  (rows per second), from when the trainers start: the stream runs ahead of training, so
  the lookahead is full and the plan is never cut;
* **online, slow**: the parts land at half that rate: the trainers wait at the live edge and
  the plan is cut there.

Every run takes a checkpoint every `CHECKPOINT_EVERY` iterations and exports (a base, then
deltas: `serving.chain`) every `EXPORT_EVERY`, the offline one too, so that all pay the same.

For each: samples/s and hit rate over the measured iterations (the first fifth and the
oracle's last `max_ahead` left out), the lag behind the newest rows (p50, p99, maximum), the
freshness (seconds from a row's arrival to the first export trained on it; p50, p99), the
plan's cuts (`stream/summary.json`), and every role's RSS growth per 1,000 iterations after
the warm-up, beside the rows each PS shard has touched then and at the end (from its
checkpoint log lines): a shard's memory grows with those, up to its table, and no further.
Targets with rows arriving faster than the trainers train: samples/s >= 0.9x offline and
hit rate within 2 points of it; arriving slower: freshness p99 <= the export interval
(`EXPORT_EVERY` iterations of arriving rows) plus the time of L + D iterations (offline's);
every role's RSS flat.

    python bench/online.py --quick
    python bench/online.py --quick --rounds 3     (offline and online-fast in turn: the median pair)
    python bench/online.py --smoke                (seconds: the code path, for tests)
    python bench/online.py --quick --iterations 8000   (RSS over a longer run: its flatness;
                                                  results of their own, online-iterations-8000)
    python bench/online.py --quick --iterations 8000 --table-rows 2000   (tables touched whole
                                                  early: the PS shards' RSS plateau)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from bench import SMOKE_RESULTS, Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from bench.data import criteo_text  # noqa: E402
from common.data.spec import DataSpec  # noqa: E402
from common.data.synthetic import SyntheticGenerator  # noqa: E402
from common.job import build_job  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402
from launcher.cluster import run_cluster  # noqa: E402
from launcher.memory import read_rss, rss_curves, summarise_rss  # noqa: E402
from launcher.summary import iteration_series, summarise  # noqa: E402
from trainer.records import read_run  # noqa: E402

NAME = "online"
TOKEN = "online-bench"
SEED = 5
PART_BATCHES = 25  # batches per part: a part is a few seconds of training here
TABLES, SHARDS = 26, 2  # Criteo's categorical features; PS shards
CHECKPOINT_EVERY, EXPORT_EVERY = 50, 100
LOOKAHEAD, LEAD = 40, 4
MODEL = {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [64, 16], "top_mlp": [64]}


@dataclass(frozen=True, kw_only=True)
class Size:
    iterations: int
    batch: int
    cache_rows: int
    table_rows: int  # rows per table (TABLES tables)
    max_ahead: int = 64
    growth_span: int = 1000  # iterations after the warm-up an RSS growth figure needs
    checkpoint_every: int = CHECKPOINT_EVERY
    export_every: int = EXPORT_EVERY


SIZES = {
    "quick": Size(iterations=1500, batch=512, cache_rows=16384, table_rows=100_000),
    "smoke": Size(iterations=60, batch=128, cache_rows=4096, table_rows=1000, max_ahead=8, growth_span=20,
                  checkpoint_every=10, export_every=20),
}


def write_parts(folder: Path, size: Size) -> list[Path]:
    """The run's rows (and two parts more, so that the last batches never wait) as parts."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = SyntheticGenerator(DataSpec(format="synthetic", rows=2**40, table_sizes=(size.table_rows,) * TABLES))
    rows = PART_BATCHES * size.batch
    parts = []
    for k in range(-(-size.iterations // PART_BATCHES) + 2):
        part = folder / f"part-{k:05d}.tsv"
        if not part.exists():
            part.write_bytes(criteo_text(lambda first: gen.rows(first, first + rows), k * rows, rows, seed=SEED))
        parts.append(part)
    return parts


def job_sections(size: Size, data: dict[str, Any], run_dir: Path) -> dict[str, dict]:
    return {
        "cluster": {"request_timeout_s": 120, "fetch_timeout_s": 300},
        "oracle": {"lookahead": LOOKAHEAD, "prefetch_lead": LEAD, "cache_rows": size.cache_rows,
                   "max_ahead": size.max_ahead},
        "ps": {"shards": SHARDS},
        "trainers": {"count": 2},
        "data": {"format": "criteo", "table_sizes": [size.table_rows] * TABLES, "workers": 1, **data},
        "model": dict(MODEL),
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": size.batch, "max_iterations": size.iterations},
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "every": size.checkpoint_every},
        "export": {"dir": str(run_dir / "exports"), "every_iterations": size.export_every},
    }


class Writer(threading.Thread):
    """Lands `parts` in `folder` at `rows_per_s`: two at once, the rest from when the
    trainers start (their first records), each when the rate says, by rename."""

    def __init__(self, parts: list[Path], folder: Path, rows_per_s: float, rows_per_part: int, started: Path) -> None:
        super().__init__(daemon=True)
        self.parts, self.folder, self.started = parts, folder, started
        self.every_s = rows_per_part / rows_per_s
        self.stop = threading.Event()

    def run(self) -> None:
        for part in self.parts[:2]:
            self._land(part)
        while not self.started.exists() and not self.stop.is_set():
            time.sleep(0.05)
        t0 = time.monotonic()
        for k, part in enumerate(self.parts[2:], start=1):
            if self.stop.wait(max(0.0, t0 + k * self.every_s - time.monotonic())):
                return
            self._land(part)

    def _land(self, part: Path) -> None:
        hidden = self.folder / f".{part.name}.tmp"
        shutil.copyfile(part, hidden)
        os.replace(hidden, self.folder / part.name)


def run_case(name: str, size: Size, out: Path, parts: list[Path], rate: float | None) -> dict[str, Any]:
    """One run: offline over `parts` (rate None), or online with parts landing at `rate` rows/s."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    writer = None
    if rate is None:
        data: dict[str, Any] = {"path": [str(p) for p in parts]}
    else:
        incoming = run_dir / "incoming"
        incoming.mkdir()
        data = {"path": str(incoming / "*.tsv"), "watch": True, "poll_s": 0.1}
        writer = Writer(parts, incoming, rate, PART_BATCHES * size.batch, run_dir / "trainer-0.jsonl")
    spec = run_dir / f"{name}.toml"
    spec.write_text(spec_toml(f"online-{name}", SEED, job_sections(size, data, run_dir)))
    job = build_job(load_spec(spec))
    print(f"running {name} ...", file=sys.stderr, flush=True)
    if writer is not None:
        writer.start()
    try:
        run_cluster(job, run_dir, token=TOKEN)
    finally:
        if writer is not None:
            writer.stop.set()
            writer.join()
    return figures_of(run_dir, size, stream=rate is not None)


def figures_of(run_dir: Path, size: Size, *, stream: bool) -> dict[str, Any]:
    warmup = max(2, size.iterations // 5)
    records = read_run(run_dir, 2)
    summary = summarise(records, mode="bagpipe", global_batch=size.batch, warmup=warmup, cooldown=size.max_ahead,
                        trainers=2)
    series = iteration_series(records, trainers=2)
    curves = rss_curves(read_rss(run_dir), series.iterations, series.end_time)
    rss = summarise_rss(curves, warmup, min_span=size.growth_span)
    # the second half of the measured iterations alone: past a step while a window fills
    # (the stream's, when rows arrive faster than the trainers train), is the growth gone?
    late = summarise_rss(curves, (warmup + size.iterations - size.max_ahead) // 2, min_span=size.growth_span)
    out: dict[str, Any] = {
        "samples_per_s": summary.samples_per_s, "hit_rate": summary.hit_rate,
        "wait_directive_ms": 1000 * summary.phase_s.get("wait_directive", math.nan),
        "rss": {role: f.to_json() for role, f in rss.items()},
        "rss_late_growth_mb_per_1k": {role: f.growth_mb_per_1k for role, f in late.items()},
    }
    out["ps_rows_held"] = ps_rows_held(run_dir, warmup)
    if stream:
        out["stream"] = orjson.loads((run_dir / "checkpoints" / "stream" / "summary.json").read_bytes())
    return out


_CHECKPOINT_LINE = re.compile(rb"checkpoint (\d+): \d+ rows \((\d+) touched\)")


def ps_rows_held(run_dir: Path, warmup: int) -> dict[str, dict[str, int]]:
    """Per PS shard, the rows it had touched at its first checkpoint after the warm-up and at
    its last (`ps.service` logs both with every checkpoint)."""
    held = {}
    for log in sorted((run_dir / "logs").glob("ps-*.log")):
        points = sorted((int(c), int(n)) for c, n in _CHECKPOINT_LINE.findall(log.read_bytes()))
        after = [n for c, n in points if c >= warmup]
        if after:
            held[log.stem] = {"warm": after[0], "end": after[-1]}
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the size this machine runs in minutes (the default)")
    parser.add_argument("--out", type=Path, help="run folders and parts (default runs/bench/online, "
                                                 f"with --smoke {SMOKE_RESULTS}/online)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="offline and online-fast in turn this many times; the median pair's figures are "
                             "reported, with the range of the pairs' ratios (default %(default)s)")
    parser.add_argument("--iterations", type=int,
                        help=f"iterations of each run (default {SIZES['quick'].iterations:,}; with --smoke "
                             f"{SIZES['smoke'].iterations})")  # fmt: skip
    parser.add_argument("--table-rows", type=int,
                        help=f"rows of each of the {TABLES} tables (default {SIZES['quick'].table_rows:,}; with "
                             f"--smoke {SIZES['smoke'].table_rows:,}): small ones are all touched early, and a PS "
                             "shard's RSS should then stay flat")  # fmt: skip
    add_result_options(parser, NAME, "60 iterations of 128 on tables of 1,000 rows")
    args = parser.parse_args()
    size = SIZES["smoke" if args.smoke else "quick"]
    if args.iterations is not None:
        if args.iterations < 5 * size.max_ahead:
            parser.error(f"--iterations: at least {5 * size.max_ahead} (the warm-up and the oracle's last "
                         f"{size.max_ahead} are left out), got {args.iterations}")
        size = dataclasses.replace(size, iterations=args.iterations)
    if args.table_rows is not None:
        if args.table_rows < 1:
            parser.error(f"--table-rows: at least 1, got {args.table_rows}")
        size = dataclasses.replace(size, table_rows=args.table_rows)
    out = (args.out or (SMOKE_RESULTS / NAME if args.smoke else Path("runs/bench/online"))).resolve()
    parts = write_parts(out / "parts", size)
    pairs = []
    for _ in range(max(1, args.rounds)):
        offline = run_case("offline", size, out, parts, None)
        fast = run_case("online-fast", size, out, parts, 2 * offline["samples_per_s"])
        pairs.append((fast["samples_per_s"] / offline["samples_per_s"], offline, fast))
    pairs.sort(key=lambda pair: pair[0])
    ratio, offline, fast = pairs[(len(pairs) - 1) // 2]  # the median pair (the lower of two middle ones)
    rate = offline["samples_per_s"]
    slow = run_case("online-slow", size, out, parts, rate / 2)
    slow_rate = rate / 2
    figures = {
        "offline": offline, "online_fast": fast, "online_slow": slow,
        "throughput_vs_offline": ratio,
        "throughput_vs_offline_pairs": [pair[0] for pair in pairs],
        "hit_rate_drop_vs_offline": 100 * (offline["hit_rate"] - fast["hit_rate"]),
        "freshness_p99_s": slow["stream"].get("freshness_s_p99"),
        "freshness_target_s": size.export_every * size.batch / slow_rate + (LOOKAHEAD + LEAD) * size.batch / rate,
        "oracle_rss_growth_mb_per_1k": max(c["rss"]["oracle"]["growth_mb_per_1k"] for c in (fast, slow)),
        "max_rss_growth_mb_per_1k": max(r["growth_mb_per_1k"] for c in (offline, fast, slow)
                                        for r in c["rss"].values()),
    }
    headline = headline_of(figures)
    print(render(headline))
    print(f"online-fast against offline, pair by pair: {', '.join(f'{p[0]:.3f}' for p in pairs)} "
          f"(median {ratio:.3f})")
    print(f"freshness p99 {figures['freshness_p99_s']:.2f} s (target <= {figures['freshness_target_s']:.2f} s: the "
          f"export interval at the slow rate plus L + D iterations)")
    shard_rows = size.table_rows * TABLES // SHARDS
    for name in ("offline", "online_fast", "online_slow"):
        held = ", ".join(f"{ps} {h['warm']:,} -> {h['end']:,}" for ps, h in figures[name]["ps_rows_held"].items())
        print(f"{name}: rows touched per PS shard, warm-up end -> end (of {shard_rows:,}): {held}")
    # a run of another length or on other tables keeps results of its own (docs/benchmarks.md shows each)
    tail = []
    if args.iterations is not None:
        tail.append(f"iterations-{size.iterations}")
    if args.table_rows is not None:
        tail.append(f"table-rows-{size.table_rows}")
    variant = f"{NAME}/{'-'.join(tail)}" if tail else NAME
    path = results_path(variant.replace("/", "-"), args.json, args.smoke)
    write_results(path, bench=variant, config=config_of(args, **vars_of(size)), figures=figures, headline=headline,
                  smoke=args.smoke)
    print(f"results: {path}", file=sys.stderr)
    return 0


def vars_of(size: Size) -> dict[str, Any]:
    return {"iterations": size.iterations, "batch": size.batch, "cache_rows": size.cache_rows,
            "table_rows": size.table_rows, "part_batches": PART_BATCHES, "model": MODEL,
            "checkpoint_every": size.checkpoint_every, "export_every": size.export_every}


def headline_of(f: dict[str, Any]) -> Table:
    rows = []
    for name, key, rate in (("offline", "offline", "all there"), ("online, fast", "online_fast", "2x offline"),
                            ("online, slow", "online_slow", "0.5x offline")):
        c = f[key]
        s = c.get("stream", {})
        growth = max(r["growth_mb_per_1k"] for r in c["rss"].values())
        late = [g for g in c["rss_late_growth_mb_per_1k"].values() if not math.isnan(g)]
        ps_growth = max((r["growth_mb_per_1k"] for role, r in c["rss"].items() if role.startswith("ps-")),
                        default=math.nan)
        held = list(c.get("ps_rows_held", {}).values())
        touched = f"{max(h['warm'] for h in held):,} -> {max(h['end'] for h in held):,}" if held else "n/a"
        rows.append((name, rate, c["samples_per_s"], c["samples_per_s"] / f["offline"]["samples_per_s"],
                     100 * c["hit_rate"], s.get("cuts", 0), s.get("lag_s_p50", math.nan), s.get("lag_s_p99", math.nan),
                     s.get("freshness_s_p50", math.nan), s.get("freshness_s_p99", math.nan), growth,
                     max(late, default=math.nan), ps_growth, touched))
    return Table(("run", "rows arrive", "samples/s", "vs offline", "hit rate %", "cuts", "lag p50 s", "lag p99 s",
                  "freshness p50 s", "freshness p99 s", "max RSS growth MB/1k it",
                  "max RSS growth, 2nd half, MB/1k it", "PS RSS growth MB/1k it",
                  "rows a PS shard touched, warm-up -> end"), tuple(rows))


def render(table: Table) -> str:
    lines = ["  ".join(f"{c:>14}" for c in table.columns)]
    for row in table.rows:
        lines.append("  ".join(f"{v:>14.3g}" if isinstance(v, float) else f"{v!s:>14}" for v in row))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
