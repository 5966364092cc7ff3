"""Planner benchmark: key uses planned per second per mode, per trainer count T and per planner worker count P, and hit rates at equal C.

    .venv/bin/python bench/planner.py [--quick] [--criteo PATH] [--trainers 2 8 32] [--workers 1 2] [--rounds 3]

Throughput: the stream is Criteo-like and synthetic, generated inline (26 tables, global batch
16,384, T = 4, L = 200): per table, 92% of the accesses go to the hottest 1% of rows
(Zipf-shaped inside), the rest are uniform; ranks are scattered over the key space by a
multiplicative hash. One key use = one (sample, feature) id planned. Each mode plans the
stream twice, a fresh planner each time: the first pass also pays for the fresh pages of
the planner's state (20 to 35% of it); `steady`, the second, is what a running oracle plans
at, and the JSON's `key_uses_per_s`.

Scaling (bagpipe; `--trainers`, `--workers`): the same stream (the same global batches) planned
with each T and each P (`oracle.planner_workers`), C = 4 x the largest per-trainer working set at
that T (so the cache of one trainer holds about as many of its keys at every T), in `--rounds`
rounds that alternate the settings (the machine is shared: each figure is the median of its
rounds). Wall-clock key uses/s from the first push to `finish` (P > 1 plans in worker
processes, whose CPU this process's clock would miss; their start, seconds once per run while
they load the kernels, is left out), and in (key, trainer) pairs/s, the CPU of every
process per key use (the workers' own count of their planning), and the bagpipe hit rate.

What a batch costs the planner: its key uses (reading the batch, every input's slot); its
distinct (key, trainer) pairs (each trainer's copy of a key it uses: planning, the directives'
lists); the plan's fetches and capacity victims; the shared keys' rows of T slots in the sync
lists; and, for each trainer that evicts, one pass over its C slots that counts its copies in
buckets by next use (only the first buckets are then ordered, and made heaps as victims come
from them), about 4 ns x T x C here, the slots being out of the CPU's caches at T = 32. On a stream whose hot keys every
trainer uses, all of these but the key uses grow with T, the same global batches planned: from
T = 2 to 32 here, per batch, the pairs 1.9 x (51,862 to 96,600 of 425,984 key uses), the
fetches 2.2 x (17,681 to 38,238), the victims 3.2 x (7,862 to 25,517), the sync lists' slots
18 x (49,172 to 872,966), T x C 1.9 x (209,776 to 401,280). So key uses/s fall with T whatever
the planner does, and pairs/s is the figure to compare across T. It falls too, less, as a pair
brings more fetches, victims and sync-list slots at larger T: in CPU time on a shared 2-core
machine (2026-12-07, medians of 2 runs, which spread by up to 25%), 9.2, 4.9 and 3.4 M key
uses/s at T = 2, 8 and 32 are 1.12, 0.81 and 0.76 M pairs/s.

Hit rates (bagpipe vs static-cache vs no-cache at the same C, T = 2): on the real Criteo
Kaggle 8,000-row sample and on the calibrated synthetic generator (top 1% of rows = 92% of
accesses), both read with the project's data readers (`common.data`). C is a multiple of the
largest per-trainer working set of one iteration; the static cache pins the hottest rows of
a frequency pass over the whole stream and keeps one working set of room for the rest.

Memory (bagpipe and no-cache, the settings of `bench/e2e.py --batch 256`: T = 2, global batch
256, L = 200, D = 8, C = 32,768): the keys the planner keeps state for (`Planner.keys_held`)
along a long inline stream, beside the distinct keys read so far, which is what a planner that
remembered every write-back's version would hold.

`--smoke`: 4 iterations of 1,024 for the throughput and the scaling (one round, T = 2, 8), 8,192
synthetic rows beside the sample for the hit rates, 100 iterations of the memory stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.data.dataset import open_dataset  # noqa: E402
from common.data.samples import CRITEO_KAGGLE  # noqa: E402
from common.data.spec import DataSpec  # noqa: E402
from common.keys import TableLayout  # noqa: E402
from oracle.compiled import compile_planner  # noqa: E402
from oracle.config import PlannerConfig, hottest_keys, required_capacity  # noqa: E402
from oracle.planner import Planner  # noqa: E402

NAME = "planner"
HIT_T = 2
HIT_BATCH = 128  # 62 iterations of the 8,000-row sample
HIT_L, HIT_D = 50, 4
HIT_FACTORS = (2, 4)
HIT_MODES = ("bagpipe", "static-cache", "no-cache")
MEMORY_MODES = ("bagpipe", "no-cache")
# Per size: throughput iterations and batch, synthetic rows of the hit rates, memory-stream
# iterations and how often it is read.
SIZES = {"full": (260, 16_384, 256 * 1024, 5000, 500), "quick": (24, 16_384, 32 * 1024, 1000, 250),
         "smoke": (4, 1024, 8 * 1024, 100, 50)}  # fmt: skip

TABLE_SIZES = (
    1460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5_683, 8_351_593, 3_194,
    27, 14_992, 5_461_306, 10, 5_652, 2_173, 4, 7_046_547, 18, 15, 286_181, 105, 142_572,
)  # Criteo Kaggle cardinalities


def criteo_like(rng: np.random.Generator, batch: int, sizes: tuple[int, ...]) -> np.ndarray:
    """One global batch int64 [batch, len(sizes)] of global keys."""
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    cols = []
    for n, off in zip(sizes, offsets, strict=True):
        hot = max(1, n // 100)
        zipf = (rng.zipf(1.2, size=batch) - 1) % hot
        cold = rng.integers(0, n, size=batch)
        rank = np.where(rng.random(batch) < 0.92, zipf, cold)
        cols.append(off + (rank * 2_654_435_761) % n)
    return np.stack(cols, axis=1).astype(np.int64)


def throughput(mode: str, batches: list[np.ndarray], capacity: int, lookahead: int, hot: np.ndarray) -> dict[str, float]:
    """Key uses planned per second of this process's CPU time (the cores are shared; the
    planner runs on one), twice over the stream with a fresh planner each time: the first
    pass also pays the kernel for the fresh pages of the planner's state, the second plans
    in memory a run's earlier iterations have already touched, as a running oracle does."""
    config = PlannerConfig(
        num_trainers=4,
        lookahead=lookahead,
        prefetch_lead=8,
        capacity=capacity,
        mode=mode,  # type: ignore[arg-type]
        total_rows=sum(TABLE_SIZES),
        hot_keys=hot if mode == "static-cache" else np.zeros(0, np.int64),
    )
    compile_planner(mode)  # compile (or load) every kernel outside the timing
    rates = {}
    for run in ("first_pass", "steady"):
        planner = Planner(config)
        start = time.process_time()
        for b in batches:
            planner.push(b)
        planner.finish()
        rates[run] = sum(b.size for b in batches) / (time.process_time() - start)
    return rates


def scaled_run(batches: list[np.ndarray], trainers: int, workers: int, capacity: int) -> dict[str, float]:
    """One fresh bagpipe planner of `trainers` and `workers` over the stream: wall-clock key
    uses/s, CPU seconds of every process per million key uses, and the hit rate."""
    config = PlannerConfig(num_trainers=trainers, lookahead=200, prefetch_lead=8, capacity=capacity, workers=workers)
    planner = Planner(config)  # P > 1: the workers start here, before the clock
    uses = sum(b.size for b in batches)
    cpu, wall = time.process_time(), time.perf_counter()
    for b in batches:
        planner.push(b)
    planner.finish()
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu + planner.worker_cpu_s
    return {"key_uses_per_s": uses / wall, "cpu_s_per_m_uses": cpu / uses * 1e6, "hit_rate": planner.stats.hit_rate}


def scaling(batches: list[np.ndarray], trainers: list[int], workers: list[int], rounds: int) -> dict[str, object]:
    """Every (T, P) in `rounds` alternating rounds (module docstring): the medians, and every
    round's figures."""
    compile_planner("bagpipe")
    capacity = {}
    for t in trainers:
        base = PlannerConfig(num_trainers=t, lookahead=0, prefetch_lead=0, capacity=1 << 30)
        capacity[t] = 4 * required_capacity(base, batches[:8])
    # the pairs each T plans: what its cost grows with (module docstring), so pairs/s beside key uses/s
    pair_share = {t: sum(pairs_of(b, t) for b in batches) / sum(b.size for b in batches) for t in trainers}
    runs: dict[tuple[int, int], list[dict[str, float]]] = {(t, p): [] for t in trainers for p in workers}
    for r in range(rounds):
        settings = list(runs)
        for t, p in settings if r % 2 == 0 else settings[::-1]:  # alternate the order too
            figures = scaled_run(batches, t, p, capacity[t])
            runs[t, p].append({**figures, "pairs_per_s": figures["key_uses_per_s"] * pair_share[t]})
    rows = []
    for (t, p), figures in runs.items():
        median = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        rows.append({"trainers": t, "workers": p, "capacity": capacity[t], "pairs_per_batch": pairs_of(batches[0], t),
                     **median, "rounds": figures})
    return {"rounds": rounds, "rows": rows}


def pairs_of(batch: np.ndarray, trainers: int) -> int:
    """The batch's distinct (key, trainer) pairs: each trainer's distinct keys, summed."""
    per = batch.shape[0] // trainers
    return sum(np.unique(batch[j * per : (j + 1) * per]).size for j in range(trainers))


def print_scaling(result: dict[str, object], iterations: int, batch: int) -> None:
    print(f"\nscaling (bagpipe): the same inline stream, {iterations} iterations x {batch:,} x 26 keys, L=200, D=8, "
          f"C = 4 x per-trainer working set; medians of {result['rounds']} alternating rounds")
    print(f"{'T':>4}{'P':>4}{'C':>9}{'pairs/batch':>13}{'M key uses/s':>14}{'M pairs/s':>11}{'CPU s/M uses':>14}"
          f"{'hit rate':>10}")
    for r in result["rows"]:  # type: ignore[attr-defined]
        print(f"{r['trainers']:>4}{r['workers']:>4}{r['capacity']:>9,}{r['pairs_per_batch']:>13,}"
              f"{r['key_uses_per_s'] / 1e6:>14.2f}{r['pairs_per_s'] / 1e6:>11.2f}{r['cpu_s_per_m_uses']:>14.3f}"
              f"{r['hit_rate']:>10.2%}")


def keys_held(mode: str, iterations: int, every: int) -> list[dict[str, int]]:
    """Every `every` iterations: the keys the planner holds, and the distinct keys read."""
    rng = np.random.default_rng(1)
    config = PlannerConfig(num_trainers=2, lookahead=200, prefetch_lead=8, capacity=32_768, mode=mode)  # type: ignore[arg-type]
    compile_planner(mode)
    planner = Planner(config)
    seen = np.zeros(sum(TABLE_SIZES), bool)
    rows = []
    for z in range(iterations):
        batch = criteo_like(rng, 256, TABLE_SIZES)
        seen[batch.reshape(-1)] = True
        planner.push(batch)
        if (z + 1) % every == 0:
            rows.append({"iteration": z + 1, "keys_held": planner.keys_held, "keys_read": int(seen.sum())})
    return rows


def print_keys_held(table: dict[str, list[dict[str, int]]]) -> None:
    print("\nkeys the planner holds along the stream (T=2, B=256, L=200, D=8, C=32,768), thousands")
    print(f"{'iteration':>10}" + "".join(f"{m:>12}" for m in table) + f"{'keys read':>12}")
    first = next(iter(table.values()))
    for i, row in enumerate(first):
        held = "".join(f"{rows[i]['keys_held'] / 1e3:>12.1f}" for rows in table.values())
        print(f"{row['iteration']:>10,}{held}{row['keys_read'] / 1e3:>12.1f}")


def dataset_keys(spec: DataSpec, batch_size: int) -> list[np.ndarray]:
    """Every training batch of a data set as global keys int64 [B, 26], read by `common.data`."""
    dataset = open_dataset(spec)
    layout = TableLayout(dataset.table_sizes)
    return [layout.to_keys(b.sparse) for b in dataset.train_batches(batch_size)]


def hit_rates(batches: list[np.ndarray], factor: int) -> dict[str, float]:
    """Hit rate of each cached mode at C = factor x the largest per-trainer working set."""
    base = PlannerConfig(num_trainers=HIT_T, lookahead=0, prefetch_lead=0, capacity=1 << 30)
    need = required_capacity(base, batches)
    capacity = factor * need
    rates: dict[str, float] = {"iterations": len(batches), "working_set": need, "capacity": capacity}
    for mode in HIT_MODES:
        hot = hottest_keys(batches, capacity - need) if mode == "static-cache" else np.zeros(0, np.int64)
        config = PlannerConfig(
            num_trainers=HIT_T, lookahead=HIT_L, prefetch_lead=HIT_D, capacity=capacity,
            mode=mode, hot_keys=hot,  # type: ignore[arg-type]
        )
        planner = Planner(config)
        for b in batches:
            planner.push(b)
        planner.finish()
        rates[mode] = planner.stats.hit_rate
    return rates


def hit_rate_table(criteo: Path, synthetic_rows: int) -> list[dict[str, object]]:
    """Rows of the hit-rate table: one per (stream, C factor)."""
    streams = {
        "criteo-kaggle-8k": DataSpec(format="criteo", path=str(criteo)),
        f"synthetic-{synthetic_rows // 1024}k": DataSpec(
            format="synthetic", top1_share=0.92, rows=synthetic_rows, seed=0
        ),
    }
    rows: list[dict[str, object]] = []
    for name, spec in streams.items():
        batches = dataset_keys(spec, HIT_BATCH)
        for factor in HIT_FACTORS:
            rows.append({"stream": name, "factor": factor, **hit_rates(batches, factor)})
    return rows


def print_hit_rates(rows: list[dict[str, object]]) -> None:
    print(f"\nhit rate at equal C: T={HIT_T}, B={HIT_BATCH}, L={HIT_L}, D={HIT_D}; "
          "C = factor x largest per-trainer working set W")
    head = f"{'stream':<18}{'iters':>6}{'W':>6}{'C':>7}" + "".join(f"{m:>14}" for m in HIT_MODES)
    print(head)
    for r in rows:
        rates = "".join(f"{r[m]:>14.1%}" for m in HIT_MODES)
        print(f"{r['stream']:<18}{r['iterations']:>6}{r['working_set']:>6}{r['capacity']:>7}{rates}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short streams (under a minute)")
    parser.add_argument("--criteo", type=Path, default=CRITEO_KAGGLE, help="Criteo Kaggle sample (raw TSV)")
    parser.add_argument("--trainers", type=int, nargs="+", default=[2, 8, 32], help="T of the scaling runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="P (oracle.planner_workers) of the scaling runs")
    parser.add_argument("--rounds", type=int, help="alternating rounds of the scaling runs (default 3; 1 with --smoke)")
    add_result_options(parser, NAME, "short streams of small batches, one scaling round at T = 2, 8")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.smoke else 3)
    trainers = [t for t in args.trainers if t <= 8] if args.smoke else args.trainers
    iterations, batch, synthetic_rows, held_iterations, every = SIZES[
        "smoke" if args.smoke else "quick" if args.quick else "full"]
    rng = np.random.default_rng(0)
    batches = [criteo_like(rng, batch, TABLE_SIZES) for _ in range(iterations)]
    per_trainer_need = required_capacity(PlannerConfig(num_trainers=4, lookahead=0, prefetch_lead=0, capacity=1 << 30), batches[:8])
    capacity = 4 * per_trainer_need
    hot = hottest_keys(batches[:8], capacity - 2 * per_trainer_need)
    modes = ("bagpipe", "no-cache", "static-cache", "local")
    throughput_results = {mode: throughput(mode, batches, capacity, 200, hot) for mode in modes}
    print(f"throughput: inline stream, {iterations} iterations x {batch:,} x 26 keys, "
          f"T=4, L=200, D=8, C={capacity}")
    print(f"{'':<14}{'M key uses/s (CPU)':^32}")
    print(f"{'mode':<14}{'first pass':>16}{'steady':>16}")
    for mode, rates in throughput_results.items():
        print(f"{mode:<14}{rates['first_pass'] / 1e6:>16.2f}{rates['steady'] / 1e6:>16.2f}")
    scaled = scaling(batches, trainers, args.workers, rounds)
    print_scaling(scaled, iterations, batch)
    rows = hit_rate_table(args.criteo, synthetic_rows)
    print_hit_rates(rows)
    held = {mode: keys_held(mode, held_iterations, every) for mode in MEMORY_MODES}
    print_keys_held(held)
    results = {
        "throughput": {
            m: {"key_uses_per_s": r["steady"], "first_pass_key_uses_per_s": r["first_pass"]}
            for m, r in throughput_results.items()
        },
        "hit_rates": {
            "trainers": HIT_T, "batch_size": HIT_BATCH, "lookahead": HIT_L, "prefetch_lead": HIT_D,
            "rows": rows,
        },
        "keys_held": held,
        "scaling": scaled,
    }
    config = config_of(args, iterations=iterations, batch=batch, capacity=capacity, synthetic_rows=synthetic_rows,
                       memory_iterations=held_iterations, scaling_trainers=trainers, scaling_rounds=rounds)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures=results,
                  headline=headline(results), smoke=args.smoke)


def headline(results: dict) -> Table:
    """Per mode: M key uses planned per CPU second (steady, T = 4), and its hit rate on each
    stream at C = 2 and 4 times the working set; then bagpipe per T and P (the scaling
    runs: wall-clock key uses/s, and the hit rate on their stream)."""
    streams = [(r["stream"], r["factor"]) for r in results["hit_rates"]["rows"]]
    columns = ("mode", "M key uses/s", *(f"hit rate % {s}, C = {f}W" for s, f in streams), "hit rate % inline stream")
    rows = []
    for mode, rate in results["throughput"].items():
        # local mode holds every row: no hit rate of its own
        hits = [100 * r[mode] if mode in r else None for r in results["hit_rates"]["rows"]]
        rows.append((mode, rate["key_uses_per_s"] / 1e6, *hits, None))
    for r in results["scaling"]["rows"]:
        rows.append((f"bagpipe T={r['trainers']} P={r['workers']} (wall)", r["key_uses_per_s"] / 1e6,
                     *(None for _ in streams), 100 * r["hit_rate"]))
    return Table(columns, tuple(rows))


if __name__ == "__main__":
    main()
