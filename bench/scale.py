#!/usr/bin/env python3
"""How each cost grows with its work: bytes per trainer and iteration against T, planner key uses/s against T, oracle RSS against distinct keys, PS RSS against touched rows, checkpoint save and restore time against rows; each series with its exponent fitted by least squares on log-log axes (0: flat, 1: linear), in one table and one log-log plot (`scale.png` beside the results).

Against T the work per trainer is held (weak scaling): a per-trainer batch of 256 Criteo-like
samples (`bench.planner.criteo_like`, 26 tables), C = 4 x the per-trainer working set, L = 20,
D = 4, bagpipe mode; a real `Planner` plans the stream and every final directive of the
middle iterations (the cold start and the final write-backs left out) is measured: its wire
size (`Directive.to_wire`), its fetches (16 request bytes a key, 76 answer bytes a row of d 16
and one float of Adagrad state plus its version), and its sums' bytes received by the busiest
trainer (`bench.sync_sum.received_bytes` of `sum_rows` over the iteration's sync list, 4 x 16
bytes a row). Planner key uses/s are per CPU second of this process, the planning alone.
`sync_bytes_ratio`: T -> those sums' bytes over a ring all-reduce's of the same (largest) sync
list. Planner workers (`oracle.planner_workers`, P) are measured where `PlannerConfig` has
them (P = 1 against 2 at the largest T, wall time from the first batch to the last directive,
the workers' start left out as in bench/planner.py: `planner_speedup_p2`, and the hit rate lost,
`planner_hit_rate_drop_p2`); where it does not, both are null.

Memory is read from /proc of a process that does nothing else: the oracle's planner (T = 2,
global batch 2,048 (1,024 with --quick; `--oracle-batch`), L = 200, D = 8, C = 32,768, a
checkpoint every 1,000 iterations) over a long stream (20,000 iterations, 6,000 with --quick;
`--oracle-iterations`), RSS against the distinct keys read so far (counted by this process, from the
same seeded stream) and `oracle_rss_growth_mb_per_1k`, the least-squares slope of RSS over
the stream's second half per 1,000 iterations; a `ShardStore` (d 16, one state float) whose
touched rows grow, at random keys and at consecutive ones, RSS above the fresh store's.
(The store's table is `common.arrays.lazy_zeros`, without transparent huge pages: with
them, as numpy's own arrays get them here, one random row made 2 MiB of the table resident
and a few thousand made all of it; 4 KiB pages hold about 16 MB after 4,096 rows.)
Checkpoints: `ps.checkpoint.save_snapshot` (fsynced) of a store's snapshot and
`load_snapshot` + `ShardStore.restore` into a fresh store, median wall time of the rounds,
sizes alternating.

    python bench/scale.py [--quick]

`--quick`: T up to 16, 6,000 oracle iterations, a 4M-row shard (under 10 minutes on 2
cores). `--smoke`: T = 2, 4 on 60 iterations of 32-sample batches, 60 oracle iterations, a
64k-row shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from bench.planner import TABLE_SIZES, criteo_like  # noqa: E402
from common.directive import Directive  # noqa: E402
from common.files import write_atomically  # noqa: E402
from common.keys import TableLayout  # noqa: E402
from oracle.compiled import compile_planner  # noqa: E402
from oracle.config import PlannerConfig, required_capacity  # noqa: E402
from oracle.planner import Planner  # noqa: E402
from ps.checkpoint import load_snapshot, save_snapshot  # noqa: E402
from ps.store import ShardConfig, ShardStore  # noqa: E402

NAME = "scale"
DIM, STATE = 16, 1  # a row of d 16 and row-wise Adagrad's one accumulator
FETCH_KEY_BYTES = 16  # a key and its min_version, int64 each
FETCH_ROW_BYTES = 4 * (DIM + STATE) + 8  # the row, its state and its version
SUM_ROW_BYTES = 4 * DIM  # a gradient row
LOOKAHEAD, LEAD = 20, 4
#: Planner workers exist once `oracle.planner_workers` does (`PlannerConfig.workers`).
HAS_WORKERS = "workers" in {f.name for f in fields(PlannerConfig)}


@dataclass(frozen=True)
class Size:
    trainers: tuple[int, ...]
    per_trainer_batch: int
    iterations: int  # of the planner runs against T
    oracle_iterations: int
    oracle_every: int  # the oracle's RSS is read every this many iterations
    oracle_batch: int  # the oracle's global batch (2 trainers)
    shard_rows: int  # the ShardStore's table
    touched: tuple[int, ...]  # rows touched at each RSS reading
    checkpoint_rows: tuple[int, ...]
    rounds: int


SIZES = {
    "full": Size((2, 4, 8, 16, 32), 256, 120, 20_000, 1000, 2048, 1 << 23, tuple(1 << k for k in range(12, 24, 2)),
                 tuple(1 << k for k in range(14, 23, 2)), 5),
    "quick": Size((2, 4, 8, 16), 256, 80, 6000, 500, 1024, 1 << 22, tuple(1 << k for k in range(12, 23, 2)),
                  tuple(1 << k for k in range(14, 21, 2)), 3),
    "smoke": Size((2, 4), 32, 60, 60, 20, 256, 1 << 16, (1 << 10, 1 << 12, 1 << 14), (1 << 10, 1 << 12), 1),
}  # fmt: skip


@dataclass(frozen=True)
class Series:
    """One cost against its work, and the exponent of cost ~ work^k fitted on log-log axes."""

    name: str
    work: str
    unit: str
    x: tuple[float, ...]
    y: tuple[float, ...]

    @property
    def exponent(self) -> float:
        ok = [(a, b) for a, b in zip(self.x, self.y, strict=True) if a > 0 and b > 0]
        if len(ok) < 2:
            return float("nan")
        slope, _ = np.polyfit(np.log([a for a, _ in ok]), np.log([b for _, b in ok]), 1)
        return float(slope)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "exponent": self.exponent}


# -- against T: a real planner's directives ------------------------------------------------


@dataclass(frozen=True)
class PlannerRun:
    """A planned stream at T trainers: per trainer and iteration (middle iterations), the
    bytes of its directive, of its fetches and received by its sums; the planning's rate."""

    trainers: int
    directive_bytes: float
    fetch_bytes: float
    sum_bytes: float
    sum_ratio: float  # the largest sync list's sum_rows bytes over a ring all-reduce's
    key_uses_per_s: float
    hit_rate: float


def planner_stream(trainers: int, size: Size) -> tuple[list[np.ndarray], PlannerConfig]:
    rng = np.random.default_rng(trainers)
    batches = [criteo_like(rng, trainers * size.per_trainer_batch, TABLE_SIZES) for _ in range(size.iterations)]
    base = PlannerConfig(num_trainers=trainers, lookahead=0, prefetch_lead=0, capacity=1 << 30)
    capacity = 4 * required_capacity(base, batches[:8])
    config = PlannerConfig(num_trainers=trainers, lookahead=LOOKAHEAD, prefetch_lead=LEAD, capacity=capacity)
    return batches, config


def plan(batches: list[np.ndarray], config: PlannerConfig) -> tuple[list[Directive], float, float, float]:
    """Every final directive, the CPU seconds and the wall seconds the planning took, and the
    hit rate. The planner is made before the clocks start: with workers (P > 1) that is
    when their processes start and load the kernels, seconds once per run, which
    bench/planner.py leaves out of its figures too."""
    planner = Planner(config)
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        out = [d for b in batches for it in planner.push(b) for d in it]
        out += [d for it in planner.finish() for d in it]
        return out, time.process_time() - cpu, time.perf_counter() - wall, planner.stats.hit_rate
    finally:
        getattr(planner, "close", lambda: None)()  # its worker processes, where it has them


def measure_planner(trainers: int, size: Size) -> PlannerRun:
    # Here, not at the top: bench.sync_sum imports torch, which the spawned children would too.
    from bench.sync_sum import received_bytes

    batches, config = planner_stream(trainers, size)
    directives, cpu_s, _, hit_rate = plan(batches, config)
    # The first L + D iterations start cold, the last L + D write every row back.
    middle = [d for d in directives if LOOKAHEAD + LEAD <= d.iteration < size.iterations - LOOKAHEAD - LEAD]
    fetched = np.array([len(d.prefetch_keys) for d in middle])
    synced = np.array([len(d.sync_now_keys) + len(d.sync_later_keys) for d in middle if d.trainer == 0])
    sums = [received_bytes("sum_rows", trainers, int(n), SUM_ROW_BYTES) for n in synced]
    largest = int(synced.max())
    return PlannerRun(
        trainers=trainers,
        directive_bytes=float(np.mean([len(d.to_wire()) for d in middle])),
        fetch_bytes=float(fetched.mean() * (FETCH_KEY_BYTES + FETCH_ROW_BYTES)),
        sum_bytes=float(np.mean(sums)),
        sum_ratio=received_bytes("sum_rows", trainers, largest, SUM_ROW_BYTES)
        / received_bytes("all_reduce", trainers, largest, SUM_ROW_BYTES),
        key_uses_per_s=sum(b.size for b in batches) / cpu_s,
        hit_rate=hit_rate,
    )


def measure_workers(trainers: int, size: Size, rounds: int) -> dict[str, float | None]:
    """P = 2 planner workers against P = 1 at `trainers`, wall time, rounds alternating; the
    hit rate each plans. Null where the planner has no workers. In a fresh process of its
    own: planned in this one after `measure_planner`, P = 2 came out slower against P = 1
    than in a fresh process (0.97 against 1.28x in one test; the cause was not found)."""
    if not HAS_WORKERS:
        return {"planner_speedup_p2": None, "planner_hit_rate_drop_p2": None}
    return _result(*_start(_workers_run, trainers, size, rounds))


def _workers_run(trainers: int, size: Size, rounds: int, queue: mp.Queue) -> None:
    compile_planner("bagpipe")  # loaded from the cache before the clocks start
    batches, config = planner_stream(trainers, size)
    walls: dict[int, list[float]] = {1: [], 2: []}
    hits: dict[int, float] = {}
    for _ in range(rounds):
        for p in (1, 2):
            _, _, wall, hits[p] = plan(batches, PlannerConfig(**{**_fields(config), "workers": p}))
            walls[p].append(wall)
    queue.put({"planner_speedup_p2": statistics.median(walls[1]) / statistics.median(walls[2]),
               "planner_hit_rate_drop_p2": hits[1] - hits[2]})


def _fields(config: PlannerConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


# -- memory, each in a process of its own -------------------------------------------------


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


#: The oracle's stream: global batches of this many rows (2 trainers), a checkpoint every
#: this many iterations (what a complete checkpoint makes safe, the planner may forget).
ORACLE_CHECKPOINT_EVERY = 1000


def _oracle_batches(iterations: int, batch: int) -> Any:
    rng = np.random.default_rng(1)
    return (criteo_like(rng, batch, TABLE_SIZES) for _ in range(iterations))


def _oracle_rss(iterations: int, every: int, batch: int, out: mp.Queue) -> None:
    """The oracle's planner over a long stream: its RSS every `every` iterations."""
    config = PlannerConfig(num_trainers=2, lookahead=200, prefetch_lead=8, capacity=32_768,
                           checkpoint_every=ORACLE_CHECKPOINT_EVERY)
    compile_planner("bagpipe")
    planner = Planner(config)
    rss = []
    for z, keys in enumerate(_oracle_batches(iterations, batch)):
        planner.push(keys)
        if (z + 1) % every == 0:
            rss.append(_rss_mb())
    out.put(rss)


def measure_oracle(iterations: int, every: int, batch: int) -> dict[str, Any]:
    """RSS against distinct keys read, and its growth per 1,000 iterations over the second half."""
    child = _start(_oracle_rss, iterations, every, batch)
    seen = np.zeros(sum(TABLE_SIZES), bool)
    distinct = []
    for z, keys in enumerate(_oracle_batches(iterations, batch)):  # the child's stream, again, meanwhile
        seen[keys.reshape(-1)] = True
        if (z + 1) % every == 0:
            distinct.append(int(seen.sum()))
    rss = _result(*child)
    at = np.arange(1, len(rss) + 1) * every
    half = len(rss) // 2
    growth = float(np.polyfit(at[half:], rss[half:], 1)[0] * 1000) if len(rss) - half >= 2 else float("nan")
    return {"iterations": at.tolist(), "distinct_keys": distinct, "rss_mb": rss, "growth_mb_per_1k": growth}


def _shard_rss(rows: int, touched: tuple[int, ...], order: str, out: mp.Queue) -> None:
    """A fresh ShardStore of `rows`, then its RSS above the fresh one's as it touches the first
    `touched[i]` rows of a random permutation (`order` "random") or of 0, 1, 2, ... ("consecutive")."""
    config = ShardConfig(shard=0, num_shards=1, layout=TableLayout((rows,)), dim=DIM, state_width=STATE)
    store = ShardStore(config)
    keys = np.random.default_rng(0).permutation(rows) if order == "random" else np.arange(rows)
    base, grown, done = _rss_mb(), [], 0
    for n in touched:
        store.gather(keys[done:n])
        done = n
        grown.append(_rss_mb() - base)
    out.put(grown)


def _start(target: Any, *args: Any) -> tuple[Any, mp.Queue]:
    """`target(*args, queue)` started in a fresh process of its own (spawned: none of this
    process's memory), and the queue it answers on."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    return proc, queue


def _result(proc: Any, queue: mp.Queue) -> Any:
    try:
        return queue.get(timeout=1200)
    finally:
        proc.join(60)


# -- checkpoints --------------------------------------------------------------------------


def measure_checkpoints(sizes: tuple[int, ...], rounds: int) -> dict[int, dict[str, float]]:
    """Median save and restore seconds per number of touched rows, sizes alternating."""
    config = ShardConfig(shard=0, num_shards=1, layout=TableLayout((max(sizes),)), dim=DIM, state_width=STATE)
    stores = {}
    for n in sizes:
        stores[n] = ShardStore(config)
        stores[n].gather(np.random.default_rng(n).choice(max(sizes), n, replace=False))
    times: dict[int, dict[str, list[float]]] = {n: {"save_s": [], "restore_s": []} for n in sizes}
    with tempfile.TemporaryDirectory(prefix="scale-checkpoints-") as folder:
        for i in range(rounds):
            for n in sizes if i % 2 == 0 else sizes[::-1]:
                directory = Path(folder) / str(n)
                start = time.perf_counter()
                save_snapshot(directory, i, stores[n].snapshot(), {"num_shards": 1})
                times[n]["save_s"].append(time.perf_counter() - start)
                fresh = ShardStore(config)
                start = time.perf_counter()
                fresh.restore(load_snapshot(directory, i)[0], i)
                times[n]["restore_s"].append(time.perf_counter() - start)
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


# -- the run ------------------------------------------------------------------------------


def series_of(runs: list[PlannerRun], oracle: dict, shard: dict[str, list[float]], touched: tuple[int, ...],
              checkpoints: dict[int, dict[str, float]]) -> list[Series]:
    ts = tuple(float(r.trainers) for r in runs)
    rows = tuple(float(n) for n in checkpoints)
    return [
        Series("directive bytes / trainer / iteration", "T", "B", ts, tuple(r.directive_bytes for r in runs)),
        Series("fetch bytes / trainer / iteration", "T", "B", ts, tuple(r.fetch_bytes for r in runs)),
        Series("sum bytes received / trainer / iteration", "T", "B", ts, tuple(r.sum_bytes for r in runs)),
        Series("planner key uses / CPU s", "T", "1/s", ts, tuple(r.key_uses_per_s for r in runs)),
        Series("oracle RSS", "distinct keys", "MB", tuple(map(float, oracle["distinct_keys"])),
               tuple(oracle["rss_mb"])),
        *(Series(f"PS RSS above a fresh store, {order} keys", "touched rows", "MB", tuple(map(float, touched)),
                 tuple(grown)) for order, grown in shard.items()),
        Series("checkpoint save (fsynced)", "rows", "s", rows, tuple(c["save_s"] for c in checkpoints.values())),
        Series("checkpoint restore", "rows", "s", rows, tuple(c["restore_s"] for c in checkpoints.values())),
    ]


def headline(series: list[dict[str, Any]]) -> Table:
    """Per series: the work's range, the cost at its ends, the fitted exponent."""
    return Table(("cost", "against", "from", "to", "cost at from", "cost at to", "unit", "exponent"), tuple(
        (s["name"], s["work"], int(s["x"][0]), int(s["x"][-1]), s["y"][0], s["y"][-1], s["unit"], s["exponent"])
        for s in series))


def plot(series: list[Series], path: Path) -> None:
    """One log-log panel per kind of work, each series with its exponent in the legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels: dict[tuple[str, str], list[Series]] = {}
    for s in series:
        panels.setdefault((s.work, s.unit), []).append(s)
    fig = Figure(figsize=(12, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    for ax, ((work, unit), group) in zip(axes, panels.items()):
        for s in group:
            ax.loglog(s.x, s.y, "o-", label=f"{s.name}: k = {s.exponent:.2f}")
        ax.set_xlabel(work)
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("bench/scale.py: cost against work, log-log (k: fitted exponent)")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    write_atomically(path, png.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (under 10 minutes)")
    parser.add_argument("--oracle-iterations", type=int, help="the oracle's stream length (default: the size's)")
    parser.add_argument("--oracle-batch", type=int, help="the oracle's global batch (default: the size's)")
    add_result_options(parser, NAME, "T = 2, 4 on short streams, a 64k-row shard")
    args = parser.parse_args()
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    size = dataclasses.replace(size, oracle_iterations=args.oracle_iterations or size.oracle_iterations,
                               oracle_batch=args.oracle_batch or size.oracle_batch)
    compile_planner("bagpipe")  # compile (or load) every kernel outside the timing
    runs = []
    print(f"against T: per-trainer batch {size.per_trainer_batch}, {size.iterations} iterations, L={LOOKAHEAD}, D={LEAD}")
    print(f"{'T':>4} {'directive B':>12} {'fetch B':>10} {'sum B':>10} {'sum/ring':>9} {'M uses/s':>9} {'hit %':>6}")
    for t in size.trainers:
        runs.append(r := measure_planner(t, size))
        print(f"{t:>4} {r.directive_bytes:>12,.0f} {r.fetch_bytes:>10,.0f} {r.sum_bytes:>10,.0f} {r.sum_ratio:>9.3f} "
              f"{r.key_uses_per_s / 1e6:>9.2f} {100 * r.hit_rate:>6.1f}", flush=True)
    workers = measure_workers(max(size.trainers), size, size.rounds)
    print(f"planner workers: {workers}" if HAS_WORKERS else "planner workers: absent (no oracle.planner_workers)")
    oracle = measure_oracle(size.oracle_iterations, size.oracle_every, size.oracle_batch)
    print(f"oracle RSS over {size.oracle_iterations:,} iterations of {size.oracle_batch} (a checkpoint every "
          f"{ORACLE_CHECKPOINT_EVERY:,}), {oracle['distinct_keys'][-1]:,} distinct keys: {oracle['rss_mb'][0]:.1f} -> "
          f"{oracle['rss_mb'][-1]:.1f} MB, {oracle['growth_mb_per_1k']:.2f} MB per 1,000 iterations (second half)")
    shard = {order: _result(*_start(_shard_rss, size.shard_rows, size.touched, order))
             for order in ("random", "consecutive")}
    checkpoints = measure_checkpoints(size.checkpoint_rows, size.rounds)
    measured = series_of(runs, oracle, shard, size.touched, checkpoints)
    series = [s.to_json() for s in measured]
    table = headline(series)
    print(f"\n{'cost':<48} {'against':<14} {'from':>10} {'to':>10} {'cost from':>12} {'cost to':>12} {'unit':>4} {'k':>6}")
    for row in table.rows:
        print(f"{row[0]:<48} {row[1]:<14} {row[2]:>10,.0f} {row[3]:>10,.0f} {row[4]:>12.4g} {row[5]:>12.4g} "
              f"{row[6]:>4} {row[7]:>6.2f}")
    path = results_path(NAME, args.json, args.smoke)
    plot(measured, path.with_suffix(".png"))
    figures = {
        "series": series,
        "planner_runs": [asdict(r) for r in runs],
        "sync_bytes_ratio": {str(r.trainers): r.sum_ratio for r in runs},
        "planner_key_uses_per_s": {str(r.trainers): r.key_uses_per_s for r in runs},
        **workers,
        "planner_workers_available": HAS_WORKERS,
        "oracle": oracle,
        "oracle_rss_growth_mb_per_1k": oracle["growth_mb_per_1k"],
        "shard_rss_mb": {"touched": list(size.touched), **shard},
        "checkpoints": {str(n): c for n, c in checkpoints.items()},
        "plot": path.with_suffix(".png").name,
    }
    config = config_of(args, **asdict(size))
    write_results(path, bench=NAME, config=config, figures=figures, headline=table, smoke=args.smoke)


if __name__ == "__main__":
    main()
