"""Planner benchmark: key uses planned per second per mode, and hit rates at equal C.

    .venv/bin/python bench/planner.py [--quick] [--json PATH]

The stream is Criteo-like and synthetic (26 tables, global batch 16,384, T = 4, L = 200): per
table, 92% of the accesses go to the hottest 1% of rows (Zipf-shaped inside), the rest are
uniform; ranks are scattered over the key space by a multiplicative hash. One key use = one
(sample, feature) id planned. The hit-rate part uses a smaller stream of the same shape and
the same C for every mode; the static cache pins the hottest rows of a frequency pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle.config import PlannerConfig, hottest_keys, required_capacity  # noqa: E402
from oracle.planner import Planner  # noqa: E402

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


def throughput(mode: str, batches: list[np.ndarray], capacity: int, lookahead: int, hot: np.ndarray) -> float:
    config = PlannerConfig(
        num_trainers=4,
        lookahead=lookahead,
        prefetch_lead=8,
        capacity=capacity,
        mode=mode,  # type: ignore[arg-type]
        total_rows=sum(TABLE_SIZES),
        hot_keys=hot if mode == "static-cache" else np.zeros(0, np.int64),
    )
    planner = Planner(config)
    planner.push(batches[0][:4])  # warm the compiled kernels outside the timing
    planner = Planner(config)
    # CPU time of this process: the cores are shared, and the planner runs on one
    start = time.process_time()
    for b in batches:
        planner.push(b)
    planner.finish()
    elapsed = time.process_time() - start
    return sum(b.size for b in batches) / elapsed


def hit_rates(rng: np.random.Generator, iterations: int) -> dict[str, float]:
    """Hit rate of each cached mode at the same C on a smaller skewed stream."""
    sizes = tuple(max(3, n // 10) for n in TABLE_SIZES)
    batches = [criteo_like(rng, 2048, sizes) for _ in range(iterations)]
    base = PlannerConfig(num_trainers=4, lookahead=0, prefetch_lead=0, capacity=1 << 30)
    need = required_capacity(base, batches)
    capacity = 2 * need
    rates = {}
    for mode in ("no-cache", "static-cache", "bagpipe"):
        hot = hottest_keys(batches, capacity - need) if mode == "static-cache" else np.zeros(0, np.int64)
        config = PlannerConfig(
            num_trainers=4, lookahead=50, prefetch_lead=4, capacity=capacity, mode=mode, hot_keys=hot  # type: ignore[arg-type]
        )
        planner = Planner(config)
        for b in batches:
            planner.push(b)
        planner.finish()
        rates[mode] = planner.stats.hit_rate
    rates["capacity"] = capacity
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short streams (under a minute)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    iterations = 24 if args.quick else 260
    batches = [criteo_like(rng, 16_384, TABLE_SIZES) for _ in range(iterations)]
    per_trainer_need = required_capacity(PlannerConfig(num_trainers=4, lookahead=0, prefetch_lead=0, capacity=1 << 30), batches[:8])
    capacity = 4 * per_trainer_need
    hot = hottest_keys(batches[:8], capacity - 2 * per_trainer_need)
    results: dict[str, dict[str, float]] = {}
    for mode in ("bagpipe", "no-cache", "static-cache", "local"):
        results[mode] = {"key_uses_per_s": throughput(mode, batches, capacity, 200, hot)}
    rates = hit_rates(rng, 40 if args.quick else 200)
    for mode in ("bagpipe", "no-cache", "static-cache"):
        results[mode]["hit_rate"] = rates[mode]
    print(f"stream: {iterations} iterations x 16,384 x 26 keys, T=4, L=200, D=8, C={capacity}")
    print(f"hit rates: smaller stream, equal C={int(rates['capacity'])}, L=50")
    print(f"{'mode':<14}{'M key uses/s (CPU)':>20}{'hit rate':>10}")
    for mode, r in results.items():
        rate = f"{r['hit_rate']:.1%}" if "hit_rate" in r else "-"
        print(f"{mode:<14}{r['key_uses_per_s'] / 1e6:>20.2f}{rate:>10}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
